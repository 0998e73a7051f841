"""Qwen3.5's mixture-of-experts language model (HF ``Qwen3_5MoeForCausalLM``, model_type ``qwen3_5_moe_text``): the
module of :mod:`functrain.models.qwen3_next` with Qwen3.5's Gated DeltaNet projections and experts on every layer."""

from typing import Any

from functrain.models import qwen3_next
from functrain.models.configs.qwen3_5_moe_text import FIXED_MOE_KEYS, Qwen3_5MoeTextConfig


def from_hf_config(hf: dict[str, Any]) -> Qwen3_5MoeTextConfig:
    """Qwen3_5MoeTextConfig from an HF config.json dict (the Qwen3-Next MoE keys transformers does not read for this
    model are left out, as it leaves them)."""
    return qwen3_next.config_from_hf(Qwen3_5MoeTextConfig, hf, ignored=FIXED_MOE_KEYS)


def to_hf_config(config: Qwen3_5MoeTextConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3_5MoeForCausalLM."""
    return qwen3_next.config_to_hf(config, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", exclude=FIXED_MOE_KEYS)


build = qwen3_next.build  # the Flax module is Qwen3-Next's; the config switches its variations
