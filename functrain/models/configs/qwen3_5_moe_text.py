"""``model.name: qwen3_5_moe_text``: Qwen3.5's mixture-of-experts language model: Qwen3.5's layers with experts and a
gated shared expert on every layer, the top-k weights always renormalised (:mod:`functrain.models.qwen3_5_moe`)."""

from typing import Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.qwen3_next import HybridConfig
from functrain.models.configs.qwen_moe import QwenMoeOptions
from functrain.models.family import Family

# Qwen3-Next's MoE keys that Qwen3.5-MoE has not (transformers reads none of them: every layer has experts).
FIXED_MOE_KEYS = ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob")


class Qwen3_5MoeTextConfig(HybridConfig, QwenMoeOptions):
    """Qwen3.5-MoE (text) hyper-parameters, named as in HF's config.json."""

    name: Literal["qwen3_5_moe_text"] = "qwen3_5_moe_text"
    vocab_size: int = pydantic.Field(248320, gt=0)
    num_hidden_layers: int = pydantic.Field(40, gt=0)
    num_experts: int = pydantic.Field(256, gt=0)
    num_experts_per_tok: int = pydantic.Field(8, gt=0)
    moe_intermediate_size: int = pydantic.Field(512, gt=0)
    shared_expert_intermediate_size: int = pydantic.Field(512, gt=0)
    # Fixed: experts on every layer, their top-k weights renormalised.
    norm_topk_prob: Literal[True] = True
    decoder_sparse_step: Literal[1] = 1
    mlp_only_layers: tuple[()] = ()

    def shared_expert_size(self) -> int:
        """``shared_expert_intermediate_size``."""
        return self.shared_expert_intermediate_size

    def decoder_shape(self) -> DecoderShape:
        """The hybrid's shape with the active MLP width and the router (every layer has experts)."""
        return self.active_shape(self.hybrid_shape(0), self.num_hidden_layers)

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's type and whether it has experts (every layer has)."""
        return self.moe_layer_kinds(super().layer_kinds())


FAMILY = Family(
    name="qwen3_5_moe_text",
    config=Qwen3_5MoeTextConfig,
    code="functrain.models.qwen3_5_moe",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,
    pipeline=False,
    generation_cache=True,
    hf_model_types=("qwen3_5_moe_text",),
    hf_mapping="torch_bridge.hf.hybrid_mappings:QWEN3_NEXT",
)
