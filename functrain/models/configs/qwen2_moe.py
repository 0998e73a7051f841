"""``model.name: qwen2_moe``: Qwen2-MoE's family; its config class, shared with its kin, is in
:mod:`functrain.models.configs.qwen_moe`."""

from functrain.models.configs.qwen_moe import Qwen2MoeConfig
from functrain.models.family import Family

FAMILY = Family(
    name="qwen2_moe",
    config=Qwen2MoeConfig,
    code="functrain.models.qwen2_moe",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("qwen2_moe",),
    hf_mapping="torch_bridge.hf.mappings:QWEN_MOE",
)
