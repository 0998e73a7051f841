"""The HF ⇄ functrain tensor table of Gemma 4 (``gemma4_text``), in the terms of :mod:`torch_bridge.hf.mappings`.

Each layer: the attention's q/k/o (and v, except on the global layers whose keys are the values) with their biases,
``q_norm`` and ``k_norm`` (the value norm has no weight; the layers reusing earlier layers' keys and values, stored
as ``kv_shared_layers_{j}``, have only q/o and ``q_norm``), Gemma's four norms, the MLP, the ``layer_scalar`` buffer
(kept frozen in training); with per-layer inputs its ``per_layer_input_gate``, ``per_layer_projection`` and
``post_per_layer_input_norm``; with the MoE block its ``router`` (``proj``, ``scale``, ``per_expert_scale``), the
stacked ``experts.gate_up_proj`` [E, 2 x inter, hidden] and ``experts.down_proj`` [E, hidden, inter] as
transformers saves them, and the experts' three norms. The model: the embeddings (with per-layer inputs also
``embed_tokens_per_layer``, ``per_layer_model_projection`` and ``per_layer_projection_norm``), the final norm and an
untied ``lm_head``.
"""

from functrain.models.configs.gemma4 import Gemma4TextConfig
from torch_bridge.hf.mappings import Path, Rule, TensorMapping, _dense_mlp, _fused_experts, _linear

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_MOE_NORMS = ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")


def _norm(hf: str, path: Path) -> Rule:
    return Rule(f"{hf}.weight", (path + ("scale",),))


def _attention_weights(cfg: Gemma4TextConfig, i: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Layer ``i``'s attention projections and weighted norms (a layer reusing keys and values has neither keys' nor
    values' in the checkpoint; keys that are the values, no ``v_proj``)."""
    if cfg.kv_shared(i):
        return ("q_proj", "o_proj"), ("q_norm",)
    keys_values = ("k_proj",) if cfg.values_are_keys(i) else ("k_proj", "v_proj")
    return ("q_proj", *keys_values, "o_proj"), ("q_norm", "k_norm")


def _layer_rules(cfg: Gemma4TextConfig, i: int) -> list[Rule]:
    hf, layer = f"model.layers.{i}", cfg.layer_name(i)
    attn, hf_attn = (layer, "self_attn"), f"{hf}.self_attn"
    projections, norms = _attention_weights(cfg, i)
    rules = [rule for proj in projections for rule in _linear(f"{hf_attn}.{proj}", attn + (proj,), cfg.attention_bias)]
    rules += [_norm(f"{hf_attn}.{norm}", attn + (norm,)) for norm in norms]
    rules += _dense_mlp(f"{hf}.mlp", (layer, "mlp"), bias=False)
    rules += [_norm(f"{hf}.{norm}", (layer, norm)) for norm in _NORMS]
    rules.append(Rule(f"{hf}.layer_scalar", ((layer, "layer_scalar"),)))
    if cfg.per_layer_inputs:
        rules += _linear(f"{hf}.per_layer_input_gate", (layer, "per_layer_input_gate"), bias=False)
        rules += _linear(f"{hf}.per_layer_projection", (layer, "per_layer_projection"), bias=False)
        rules.append(_norm(f"{hf}.post_per_layer_input_norm", (layer, "post_per_layer_input_norm")))
    if cfg.enable_moe_block:
        router = (layer, "router")
        rules += _linear(f"{hf}.router.proj", router + ("proj",), bias=False)
        rules += [Rule(f"{hf}.router.{name}", (router + (name,),)) for name in ("scale", "per_expert_scale")]
        rules += _fused_experts(f"{hf}.experts", (layer, "experts"), cfg.moe_intermediate_size or 0)
        rules += [_norm(f"{hf}.{norm}", (layer, norm)) for norm in _MOE_NORMS]
    return rules


def _gemma4_rules(cfg: Gemma4TextConfig) -> list[Rule]:
    rules = [Rule("model.embed_tokens.weight", (("embed_tokens", "embedding"),))]
    if cfg.per_layer_inputs:
        rules += [
            Rule("model.embed_tokens_per_layer.weight", (("embed_tokens_per_layer", "embedding"),)),
            *_linear("model.per_layer_model_projection", ("per_layer_model_projection",), bias=False),
            _norm("model.per_layer_projection_norm", ("per_layer_projection_norm",)),
        ]
    for i in range(cfg.num_hidden_layers):
        rules += _layer_rules(cfg, i)
    rules.append(_norm("model.norm", ("norm",)))
    if not cfg.tie_word_embeddings:
        rules += _linear("lm_head", ("lm_head",), bias=False)
    return rules


def _gemma4_ignorable(name: str, cfg: Gemma4TextConfig) -> bool:
    return cfg.tie_word_embeddings and name == "lm_head.weight"


GEMMA4 = TensorMapping(_gemma4_rules, _gemma4_ignorable)
