"""Qwen3-MoE (:mod:`functrain.models.qwen_moe`): the family's registry entry and HF config conversion."""

from functrain.models.configs.qwen_moe import Qwen3MoeConfig
from functrain.models.qwen_moe import build
from functrain.models.qwen_moe import qwen3_moe_from_hf_config as from_hf_config
from functrain.models.qwen_moe import qwen3_moe_to_hf_config as to_hf_config

__all__ = ["MODEL_SPEC", "build", "from_hf_config", "to_hf_config"]

MODEL_SPEC = dict(config_cls=Qwen3MoeConfig, build=build, kind="causal_lm")
