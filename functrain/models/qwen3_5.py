"""Qwen3.5's language model (HF ``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``): the module of
:mod:`functrain.models.qwen3_next` with separate Gated DeltaNet input projections and a SwiGLU MLP on every layer."""

from typing import Any

from functrain.models import qwen3_next
from functrain.models.configs.qwen3_5_text import Qwen3_5TextConfig


def from_hf_config(hf: dict[str, Any]) -> Qwen3_5TextConfig:
    """Qwen3_5TextConfig from an HF config.json dict."""
    return qwen3_next.config_from_hf(Qwen3_5TextConfig, hf)


def to_hf_config(config: Qwen3_5TextConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3_5ForCausalLM."""
    return qwen3_next.config_to_hf(config, "qwen3_5_text", "Qwen3_5ForCausalLM")


build = qwen3_next.build  # the Flax module is Qwen3-Next's; the config switches its variations
