"""Mistral: Llama without biases and with sliding-window attention (``sliding_window``) on every layer.

The module is Llama's (`functrain.models.llama`); only the config differs.
"""

from typing import Any

from functrain.models import llama
from functrain.models.configs.mistral import MistralConfig


def from_hf_config(hf: dict[str, Any]) -> MistralConfig:
    """MistralConfig from an HF config.json dict."""
    return llama.config_from_hf(MistralConfig, hf)


def to_hf_config(config: MistralConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as MistralForCausalLM."""
    return llama.config_to_hf(config, "mistral", "MistralForCausalLM", exclude={"attention_bias", "mlp_bias"})


build = llama.build  # the Flax module is Llama's; the config switches its variations
