"""Gemma 4's config.json read and written as transformers' ``Gemma4TextConfig`` reads and writes it: the rope nested
by layer type (``rope_parameters``, transformers' defaults when absent; ``proportional`` or any type
:mod:`functrain.models.rope` computes), the layers' head widths and key/value heads from ``per_layer_config`` (or
``global_head_dim`` / ``num_global_key_value_heads``, from which transformers derives it), and a one-line refusal of
each setting functrain does not implement."""

from typing import Any

from functrain.errors import ConfigError
from functrain.models.configs.gemma4 import Gemma4Rope, Gemma4TextConfig
from functrain.models.configs.hf import NO_DROPOUT, refuse_unimplemented
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.hf_common import hf_config_dict
from functrain.models.rope import hf_rope_parameters, parse_hf_rope

MODEL_TYPE = "gemma4_text"
UNIMPLEMENTED = {
    **NO_DROPOUT,
    "use_bidirectional_attention": (None, "functrain's Gemma 4 attends causally"),
}
PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what functrain reads from per_layer_config
ROPE_KEYS = {"full_attention": "full_rope", "sliding_attention": "sliding_rope"}
PROPORTIONAL_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
# Layer-dependent config keys that are not fields (transformers pops them to derive per_layer_config).
DERIVED_KEYS = ("per_layer_config", "global_head_dim", "num_global_key_value_heads")


def _refusal(message: str) -> ConfigError:
    return ConfigError(f"config.json: {message} for {MODEL_TYPE}; fix config.json")


def _rope(layer_type: str, parameters: Any) -> Gemma4Rope:
    """One layer type's ``rope_parameters`` entry (proportional, or what parse_hf_rope reads)."""
    if not isinstance(parameters, dict) or "rope_theta" not in parameters:
        raise _refusal(f"rope_parameters[{layer_type!r}] {parameters!r} names no rope_theta")
    if parameters.get("rope_type") == "proportional":
        unknown = sorted(set(parameters) - PROPORTIONAL_KEYS)
        if unknown:
            raise _refusal(f"proportional rope does not implement {', '.join(unknown)}")
        fields = {
            key: parameters[key] for key in ("rope_theta", "partial_rotary_factor", "factor") if key in parameters
        }
        return Gemma4Rope(proportional=True, **fields)
    try:
        parsed, scaling = parse_hf_rope({"rope_parameters": parameters})
    except ValueError as err:
        raise _refusal(f"rope_parameters[{layer_type!r}]: {err}") from None
    return Gemma4Rope(rope_theta=parsed["rope_theta"], rope_scaling=scaling)


def _ropes(nested: Any) -> dict[str, Gemma4Rope]:
    if nested is None:  # transformers' defaults: the config class's
        return {}
    if not isinstance(nested, dict) or not set(nested) <= set(ROPE_KEYS):
        raise _refusal(f"rope_parameters are nested by layer type ({', '.join(ROPE_KEYS)}), not {nested!r}")
    return {ROPE_KEYS[layer_type]: _rope(layer_type, parameters) for layer_type, parameters in nested.items()}


def _per_layer(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """``layer_head_dims`` / ``layer_kv_heads`` from ``per_layer_config`` (keys: layer indices, as strings in JSON),
    or nothing when it is absent (the fields derive them from ``global_head_dim``)."""
    overrides = hf["per_layer_config"]
    if not isinstance(overrides, dict):
        raise _refusal(f"per_layer_config {overrides!r} is not a mapping of layer index to settings")
    by_layer: dict[int, dict[str, Any]] = {}
    for index, settings in overrides.items():
        unknown = sorted(set(settings) - set(PER_LAYER_KEYS))
        if unknown:
            raise _refusal(f"per_layer_config[{index!r}] sets {', '.join(unknown)}, which functrain does not vary by "
                           f"layer (only {', '.join(PER_LAYER_KEYS)})")  # fmt: skip
        if not str(index).isdigit() or not 0 <= int(index) < layers:
            raise _refusal(f"per_layer_config names layer {index!r} of a model of {layers} layers")
        by_layer[int(index)] = settings
    head_dim, kv_heads = hf.get("head_dim", 256), hf.get("num_key_value_heads", 4)
    return {
        "layer_head_dims": tuple(by_layer.get(i, {}).get("head_dim", head_dim) for i in range(layers)),
        "layer_kv_heads": tuple(by_layer.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(layers)),
    }


def from_hf_config(hf: dict[str, Any]) -> Gemma4TextConfig:
    """Gemma4TextConfig from an HF config.json dict (``gemma4_text``); a setting it does not implement is named."""
    refuse_unimplemented(hf, MODEL_TYPE, UNIMPLEMENTED)
    hf = dict(hf)
    layers = hf.get("num_hidden_layers", Gemma4TextConfig.model_fields["num_hidden_layers"].default)
    overrides = _ropes(hf.pop("rope_parameters", None))
    if "per_layer_config" in hf:  # then transformers ignores global_head_dim and num_global_key_value_heads
        overrides.update(_per_layer(hf, layers))
        for key in DERIVED_KEYS:
            hf.pop(key, None)
    return Gemma4TextConfig.from_hf_dict(hf, **overrides)


def to_hf_config(config: Gemma4TextConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Gemma4ForCausalLM (every layer's type written out, the head widths and
    key/value heads that differ from ``head_dim`` / ``num_key_value_heads`` in ``per_layer_config``)."""
    excluded = {"sliding_rope", "full_rope", "layer_head_dims", "layer_kv_heads", *DERIVED_KEYS[1:], *MOE_RUNTIME_KEYS}
    hf = hf_config_dict(config, exclude=excluded)
    per_layer = {}
    for i in range(config.num_hidden_layers):
        settings = {"head_dim": config.head_dim_of(i), "num_key_value_heads": config.kv_heads_of(i)}
        changed = {key: value for key, value in settings.items() if value != hf[key]}
        if changed:
            per_layer[str(i)] = changed
    hf.update(
        model_type=MODEL_TYPE,
        architectures=["Gemma4ForCausalLM"],
        layer_types=list(config.resolved_layer_types()),
        rope_parameters={layer_type: _hf_rope(getattr(config, field)) for layer_type, field in ROPE_KEYS.items()},
        per_layer_config=per_layer,
        attention_dropout=0.0,
    )
    return hf


def _hf_rope(rope: Gemma4Rope) -> dict[str, Any]:
    if not rope.proportional:
        return hf_rope_parameters(rope)
    hf = {
        "rope_type": "proportional",
        "rope_theta": rope.rope_theta,
        "partial_rotary_factor": rope.partial_rotary_factor,
    }
    return hf if rope.factor == 1.0 else {**hf, "factor": rope.factor}  # transformers warns of a factor, yet reads it
