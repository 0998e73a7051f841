"""OLMo 3 (HF ``Olmo3ForCausalLM``): Llama's attention and SwiGLU MLP (no MLP biases; ``attention_bias`` on all four
projections) with OLMo's norm placement (``x + norm(attention(x))``, ``x + norm(mlp(x))``), ``q_norm``/``k_norm``
over all heads' features at once, and sliding and full layers (``layer_types``), each type with its own rope.

The module is Llama's (:mod:`functrain.models.llama`); only the config differs.
"""

from typing import Any

from functrain.errors import ConfigError
from functrain.models import llama
from functrain.models.configs.hf import NO_DROPOUT, refuse_unimplemented
from functrain.models.configs.olmo3 import Olmo3Config
from functrain.models.rope import hf_rope_parameters, parse_hf_rope

LAYER_TYPES = ("full_attention", "sliding_attention")
# transformers' theta where a layer type's rope parameters name none (the sliding layers' even when rope_theta is
# given in the old layout: Olmo3Config applies that one to the full-attention layers only).
DEFAULT_THETA = 500000.0


def _layer_rope(parameters: dict[str, Any], theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) of one layer type's rope parameters."""
    try:
        parsed, scaling = parse_hf_rope({"rope_parameters": {"rope_theta": theta, **parameters}})
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for olmo3; fix config.json") from None
    return parsed["rope_theta"], scaling


def from_hf_config(hf: dict[str, Any]) -> Olmo3Config:
    """Olmo3Config from an HF config.json dict: ``rope_parameters`` nested by layer type (transformers 5), or the
    old ``rope_theta``/``rope_scaling``, which transformers applies to the full-attention layers alone."""
    refuse_unimplemented(hf, "olmo3", NO_DROPOUT)
    hf = dict(hf)
    nested, legacy = hf.pop("rope_parameters", None), hf.pop("rope_scaling", None)
    top_theta = hf.pop("rope_theta", DEFAULT_THETA)
    if nested is not None and not (isinstance(nested, dict) and set(nested) <= set(LAYER_TYPES)):
        raise ConfigError(
            f"config.json: olmo3's rope_parameters are nested by layer type ({', '.join(LAYER_TYPES)}), not "
            f"{nested!r}; fix config.json"
        )
    nested = nested or {"full_attention": legacy or {}}
    full_theta, full_scaling = _layer_rope(nested.get("full_attention") or {}, top_theta)
    sliding_theta, sliding_scaling = _layer_rope(nested.get("sliding_attention") or {}, DEFAULT_THETA)
    return Olmo3Config.from_hf_dict(
        hf,
        rope_theta=full_theta,
        rope_scaling=full_scaling,
        sliding_rope_theta=sliding_theta,
        sliding_rope_scaling=sliding_scaling,
    )


def to_hf_config(config: Olmo3Config) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as Olmo3ForCausalLM."""
    hf = llama.config_to_hf(
        config,
        "olmo3",
        "Olmo3ForCausalLM",
        exclude={"mlp_bias", "sliding_rope_theta", "sliding_rope_scaling"},
        layer_types=list(config.resolved_layer_types()),
    )
    hf["rope_parameters"] = {
        "full_attention": hf_rope_parameters(config),
        "sliding_attention": hf_rope_parameters(config.sliding_rope()),
    }
    return hf


build = llama.build  # the Flax module is Llama's; the config switches its variations
