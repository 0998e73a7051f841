"""Qwen3 (dense): Qwen2's sliding-window layers, no fixed q/k/v bias (``attention_bias`` covers all four
projections), an explicit ``head_dim`` and RMSNorm over each query and key head (``q_norm``/``k_norm``)."""

from typing import Any

from functrain.models import llama, qwen2
from functrain.models.configs.qwen3 import Qwen3Config


def from_hf_config(hf: dict[str, Any]) -> Qwen3Config:
    """Qwen3Config from an HF config.json dict."""
    return llama.config_from_hf(Qwen3Config, {**hf, **qwen2.sliding_layer_settings(hf)})


def to_hf_config(config: Qwen3Config) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3ForCausalLM."""
    return llama.config_to_hf(
        config, "qwen3", "Qwen3ForCausalLM", exclude={"mlp_bias"}, **qwen2.hf_sliding_layer_keys(config)
    )


build = llama.build  # the Flax module is Llama's; the config switches its variations
