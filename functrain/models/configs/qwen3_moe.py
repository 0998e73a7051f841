"""``model.name: qwen3_moe``: Qwen3-MoE's family; its config class, shared with its kin, is in
:mod:`functrain.models.configs.qwen_moe`."""

from functrain.models.configs.qwen_moe import Qwen3MoeConfig
from functrain.models.family import Family

FAMILY = Family(
    name="qwen3_moe",
    config=Qwen3MoeConfig,
    code="functrain.models.qwen3_moe",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("qwen3_moe",),
    hf_mapping="torch_bridge.hf.mappings:QWEN_MOE",
)
