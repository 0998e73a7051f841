"""Gemma 3 (text, HF ``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2's module with RMSNorm on each
query and key head (``q_norm``/``k_norm``), no soft-capping by default, one global layer in six, and its own
RoPE per layer type: ``rope_theta`` (and any scaling) on global layers, ``rope_local_base_freq`` on sliding ones.
"""

from typing import Any

from functrain.errors import ConfigError
from functrain.models import gemma2
from functrain.models.configs.gemma3 import Gemma3TextConfig
from functrain.models.rope import hf_rope_parameters


def from_hf_config(hf: dict[str, Any]) -> Gemma3TextConfig:
    """Gemma3TextConfig from an HF config.json dict (v5 nests ``rope_parameters`` by layer type)."""
    hf = dict(hf)
    nested = hf.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        local = dict(nested.get("sliding_attention") or {})
        if local.pop("rope_type", "default") != "default" or set(local) - {"rope_theta"}:
            raise ConfigError(
                f"config.json: gemma3_text sliding layers support only the default rope with a "
                f"rope_theta, not {nested['sliding_attention']}; fix config.json"
            )
        hf["rope_parameters"] = nested.get("full_attention")
        if "rope_theta" in local:
            hf["rope_local_base_freq"] = local["rope_theta"]
    pattern = hf.pop("sliding_window_pattern", None)
    if pattern is not None and not hf.get("layer_types"):
        hf["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(int(hf.get("num_hidden_layers", 0)))
        ]
    return gemma2.config_from_hf(Gemma3TextConfig, hf)


def to_hf_config(config: Gemma3TextConfig) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as Gemma3ForCausalLM."""
    hf = gemma2.config_to_hf(config, "gemma3_text", "Gemma3ForCausalLM")
    hf.pop("rope_local_base_freq")
    hf["rope_parameters"] = {
        "full_attention": hf_rope_parameters(config),
        "sliding_attention": {"rope_type": "default", "rope_theta": config.rope_local_base_freq},
    }
    return hf


build = gemma2.build  # the Flax module is Gemma 2's; the config switches its variations
