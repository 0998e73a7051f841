"""Qwen3-MoE's code (:mod:`functrain.models.qwen_moe`, shared with its kin): its builder and HF config conversion."""

from functrain.models.qwen_moe import build
from functrain.models.qwen_moe import qwen3_moe_from_hf_config as from_hf_config
from functrain.models.qwen_moe import qwen3_moe_to_hf_config as to_hf_config

__all__ = ["build", "from_hf_config", "to_hf_config"]
