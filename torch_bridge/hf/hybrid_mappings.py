"""The HF ⇄ functrain tensor table of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE), in the terms of
:mod:`torch_bridge.hf.mappings`.

A ``linear_attention`` layer's ``linear_attn``: its input projections (Qwen3-Next's fused ``in_proj_qkvz`` /
``in_proj_ba``, or Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``), ``out_proj``,
``conv1d.weight`` (kept in transformers' [C, 1, K] layout), ``A_log``, ``dt_bias`` and ``norm.weight``; a
``full_attention`` layer's ``self_attn``: q (twice as wide: the output gate), k, v, o and the per-head norms; the MLP
Qwen's MoE rules name (:func:`torch_bridge.hf.mappings.qwen_moe_mlp`) or a dense SwiGLU. Released checkpoints carry
a multi-token-prediction module (``mtp.*``) that transformers does not load either: it is left out, in one log line.
"""

import functools

from functrain.models.configs.moe import MoeOptions
from functrain.models.configs.qwen3_next import HybridConfig
from torch_bridge.hf.mappings import (
    MlpRules,
    Rule,
    TensorMapping,
    _dense_mlp,
    _linear,
    _llama_ignorable,
    qwen_moe_mlp,
)

_MTP = "mtp."


def _linear_attention(hf: str, layer: str, cfg: HybridConfig) -> list[Rule]:
    path = (layer, "linear_attn")
    inputs = ("in_proj_qkvz", "in_proj_ba") if cfg.fused_linear_projections else (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # fmt: skip
    rules = [rule for proj in (*inputs, "out_proj") for rule in _linear(f"{hf}.{proj}", path + (proj,), bias=False)]
    return rules + [
        Rule(f"{hf}.conv1d.weight", (path + ("conv1d", "kernel"),)),
        Rule(f"{hf}.A_log", (path + ("A_log",),)),
        Rule(f"{hf}.dt_bias", (path + ("dt_bias",),)),
        Rule(f"{hf}.norm.weight", (path + ("norm", "scale"),)),
    ]


def _gated_attention(hf: str, layer: str, cfg: HybridConfig) -> list[Rule]:
    path = (layer, "self_attn")
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    rules = [rule for proj in projections for rule in _linear(f"{hf}.{proj}", path + (proj,), cfg.attention_bias)]
    return rules + [Rule(f"{hf}.{norm}.weight", (path + (norm, "scale"),)) for norm in ("q_norm", "k_norm")]


def _hybrid_rules(cfg: HybridConfig, fused: bool = False) -> list[Rule]:
    """The table of ``cfg`` (``fused``: transformers' in-memory experts, ``gate_up_proj`` / ``down_proj``)."""
    if isinstance(cfg, MoeOptions):
        mlp: MlpRules = qwen_moe_mlp(cfg, fused)
    else:
        mlp = lambda i, hf, layer: _dense_mlp(f"{hf}.mlp", (layer, "mlp"), bias=False)  # noqa: E731
    rules = [Rule("model.embed_tokens.weight", (("embed_tokens", "embedding"),))]
    for i in range(cfg.num_hidden_layers):
        hf, layer = f"model.layers.{i}", f"layers_{i}"
        if cfg.layer_type(i) == "linear_attention":
            rules += _linear_attention(f"{hf}.linear_attn", layer, cfg)
        else:
            rules += _gated_attention(f"{hf}.self_attn", layer, cfg)
        rules += mlp(i, hf, layer)
        rules += [
            Rule(f"{hf}.{norm}.weight", ((layer, norm, "scale"),))
            for norm in ("input_layernorm", "post_attention_layernorm")
        ]
    rules.append(Rule("model.norm.weight", (("norm", "scale"),)))
    if not cfg.tie_word_embeddings:
        rules += _linear("lm_head", ("lm_head",), bias=False)
    return rules


def _multi_token_prediction(name: str, cfg: HybridConfig) -> str | None:
    return "the multi-token-prediction module mtp.*" if name.startswith(_MTP) else None


QWEN3_NEXT = TensorMapping(
    _hybrid_rules,
    _llama_ignorable,  # a tied head's lm_head.weight
    fused_rules=functools.partial(_hybrid_rules, fused=True),
    left_out=_multi_token_prediction,
)
