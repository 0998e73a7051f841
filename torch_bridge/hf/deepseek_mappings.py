"""The HF ⇄ functrain tensor tables of DeepSeek-V3's decoder and GLM-4.5's (which shares it with grouped-query
attention), in the terms of :mod:`torch_bridge.hf.mappings`: a dense first few layers, then layers of routed experts
with a router correction bias and shared experts, then ``num_nextn_predict_layers`` multi-token-prediction layers
(:mod:`functrain.models.mtp`), each with copies of the shared embedding and head that must equal the main ones."""

import functools
import logging
import re
from typing import Any, Callable

from functrain.models import deepseek_v3
from functrain.models.configs.glm4_moe import Glm4MoeConfig
from torch_bridge.hf.mappings import (
    Path,
    Rule,
    TensorMapping,
    _dense_mlp,
    _experts,
    _fused_experts,
    _linear,
    _llama_ignorable,
)

logger = logging.getLogger(__name__)
# (config, HF prefix "model.layers.<i>", functrain layer path) -> the rules of the layer's attention.
AttentionRules = Callable[[Any, str, Path], list[Rule]]


def _latent_attention(cfg: deepseek_v3.DeepseekV3Config, hf: str, layer: Path) -> list[Rule]:
    """DeepSeek-V3's latent attention: its projections (queries through ``q_a_proj``/``q_b_proj`` with a
    ``q_lora_rank``) and the latents' norms."""
    attention = {"kv_a_proj_with_mqa": cfg.attention_bias, "kv_b_proj": False, "o_proj": cfg.attention_bias}
    attention.update(
        {"q_proj": False} if cfg.q_lora_rank is None else {"q_a_proj": cfg.attention_bias, "q_b_proj": False}
    )
    rules = []
    for proj, bias in attention.items():
        rules += _linear(f"{hf}.self_attn.{proj}", (*layer, "self_attn", proj), bias)
    for norm in ("kv_a_layernorm",) + (() if cfg.q_lora_rank is None else ("q_a_layernorm",)):
        rules.append(Rule(f"{hf}.self_attn.{norm}.weight", ((*layer, "self_attn", norm, "scale"),)))
    return rules


def _grouped_query_attention(cfg: Glm4MoeConfig, hf: str, layer: Path) -> list[Rule]:
    """GLM-4.5's attention: Llama's projections (q/k/v biases with ``attention_bias``, none on ``o_proj``) and the
    per-head q/k norms with ``use_qk_norm``."""
    biases = {"q_proj": cfg.qkv_bias, "k_proj": cfg.qkv_bias, "v_proj": cfg.qkv_bias, "o_proj": cfg.o_bias}
    rules = []
    for proj, bias in biases.items():
        rules += _linear(f"{hf}.self_attn.{proj}", (*layer, "self_attn", proj), bias)
    if cfg.qk_norm:
        rules += [
            Rule(f"{hf}.self_attn.{n}.weight", ((*layer, "self_attn", n, "scale"),)) for n in ("q_norm", "k_norm")
        ]
    return rules


def _mtp_rules(cfg: deepseek_v3.DeepseekMoeConfig, hf: str, module: str) -> list[Rule]:
    """A multi-token-prediction layer's own tensors (its decoder layer's are the other layers' kind), and its
    copies of the embedding and head, read into (and written from) the main model's one embedding and head."""
    rules = [Rule(f"{hf}.{norm}.weight", ((module, norm, "scale"),)) for norm in ("enorm", "hnorm")]
    rules.append(Rule(f"{hf}.shared_head.norm.weight", ((module, "shared_head_norm", "scale"),)))
    rules += _linear(f"{hf}.eh_proj", (module, "eh_proj"), bias=False)
    rules.append(Rule(f"{hf}.embed_tokens.weight", (("embed_tokens", "embedding"),)))
    if cfg.tie_word_embeddings:
        rules.append(Rule(f"{hf}.shared_head.head.weight", (("embed_tokens", "embedding"),)))
    else:
        rules += _linear(f"{hf}.shared_head.head", ("lm_head",), bias=False)
    return rules


def _deepseek_moe_rules(
    cfg: deepseek_v3.DeepseekMoeConfig, attention: AttentionRules, fused: bool = False
) -> list[Rule]:
    """DeepSeek-V3's decoder (and GLM-4.5's) with each layer's ``attention``: HF's layer ``i`` is
    ``dense_layers_{i}`` or ``moe_layers_{i - k}``, whose router is ``mlp.gate`` (with the correction bias),
    experts ``mlp.experts.<e>.*`` (``fused``: transformers' in-memory ``gate_up_proj`` / ``down_proj``) and
    always-on ``mlp.shared_experts``; past ``num_hidden_layers``, ``mtp_layers_{d}`` (its decoder layer ``block``)."""
    rules = [Rule("model.embed_tokens.weight", (("embed_tokens", "embedding"),))]
    for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers):
        hf, layer = f"model.layers.{i}", deepseek_v3.hf_layer_path(cfg, i)
        rules += attention(cfg, hf, layer)
        if not cfg.moe_layer(i):
            rules += _dense_mlp(f"{hf}.mlp", (*layer, "mlp"), False)
        else:
            rules += _linear(f"{hf}.mlp.gate", (*layer, "mlp", "gate"), bias=False)
            rules.append(Rule(f"{hf}.mlp.gate.{deepseek_v3.CORRECTION_BIAS}", ((*layer, deepseek_v3.CORRECTION_BIAS),)))
            experts, path = f"{hf}.mlp.experts", (*layer, "mlp", "experts")
            if fused:
                rules += _fused_experts(experts, path, cfg.moe_intermediate_size)
            else:
                rules += _experts(experts, path, cfg.n_routed_experts, ("gate_proj", "up_proj", "down_proj"))
            if cfg.n_shared_experts:
                rules += _dense_mlp(f"{hf}.mlp.shared_experts", (*layer, "shared_experts"), False)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            rules.append(Rule(f"{hf}.{norm}.weight", ((*layer, norm, "scale"),)))
        if i >= cfg.num_hidden_layers:
            rules += _mtp_rules(cfg, hf, layer[0])
    rules.append(Rule("model.norm.weight", (("norm", "scale"),)))
    if not cfg.tie_word_embeddings:
        rules += _linear("lm_head", ("lm_head",), bias=False)
    return rules


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    match = _HF_LAYER.match(name)
    return None if match is None else int(match.group(1))


def _multi_token_prediction(name: str, cfg: deepseek_v3.DeepseekMoeConfig) -> str | None:
    # Layers past those config.json's num_nextn_predict_layers describes (all of them when it is 0).
    layer = _layer_of(name)
    if layer is None or layer < cfg.num_hidden_layers + cfg.num_nextn_predict_layers:
        return None
    return f"the multi-token-prediction layer model.layers.{layer}"


def _carried_depth(cfg: deepseek_v3.DeepseekMoeConfig, names: set[str]) -> deepseek_v3.DeepseekMoeConfig:
    """``cfg`` with no multi-token prediction when the file carries none of the layers config.json announces
    (transformers saves DeepSeek-V3 and GLM-4.5 without them, its config.json still saying 1)."""
    if not cfg.num_nextn_predict_layers or any((_layer_of(n) or 0) >= cfg.num_hidden_layers for n in names):
        return cfg
    logger.info(
        "config.json announces %d multi-token-prediction layers the weights do not carry; converted without them",
        cfg.num_nextn_predict_layers,
    )
    return cfg.model_copy(update={"num_nextn_predict_layers": 0})


def _decoder_mapping(attention: AttentionRules) -> TensorMapping:
    """DeepSeek-V3's decoder tables (MoE layers, multi-token prediction) around ``attention``'s tensors."""
    return TensorMapping(
        functools.partial(_deepseek_moe_rules, attention=attention),
        _llama_ignorable,
        fused_rules=functools.partial(_deepseek_moe_rules, attention=attention, fused=True),
        left_out=_multi_token_prediction,
        fit_config=_carried_depth,
    )


DEEPSEEK_V3 = _decoder_mapping(_latent_attention)
GLM4_MOE = _decoder_mapping(_grouped_query_attention)
