"""``model.name: qwen2_moe`` and ``qwen3_moe``: Qwen2's / Qwen3's attention with a mixture of experts on the
layers ``decoder_sparse_step`` and ``mlp_only_layers`` leave sparse (:mod:`functrain.models.qwen_moe`)."""

import dataclasses
from typing import Any, Hashable, Literal, Sequence

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.moe import MoeOptions
from functrain.models.configs.qwen2 import Qwen2Config
from functrain.models.configs.qwen3 import Qwen3Config


class QwenMoeOptions(MoeOptions):
    """The HF keys Qwen2-MoE and Qwen3-MoE share (``intermediate_size`` is the dense layers' MLP width)."""

    num_experts: int = pydantic.Field(60, gt=0)
    num_experts_per_tok: int = pydantic.Field(4, gt=0)
    moe_intermediate_size: int = pydantic.Field(1408, gt=0)
    norm_topk_prob: bool = False
    decoder_sparse_step: int = pydantic.Field(1, gt=0)
    mlp_only_layers: tuple[int, ...] = ()
    output_router_logits: bool = False
    router_aux_loss_coef: float = pydantic.Field(0.001, ge=0)

    def expert_count(self) -> int:
        """``num_experts``."""
        return self.num_experts

    def experts_per_token(self) -> int:
        """``num_experts_per_tok``."""
        return self.num_experts_per_tok

    def balancing_coefficient(self) -> float:
        """``router_aux_loss_coef`` with ``output_router_logits``, else 0 (transformers' rule)."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def moe_layer(self, layer: int) -> bool:
        """transformers' rule: sparse unless in ``mlp_only_layers``, on every ``decoder_sparse_step``-th layer."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def shared_expert_size(self) -> int:
        """The width of the always-on shared expert (0: none)."""
        return 0

    def moe_layer_kinds(self, windows: Sequence[Any]) -> list[Hashable]:
        """Each layer's (attention window, whether it has experts): what a scan groups layers by."""
        return [(window, self.moe_layer(i)) for i, window in enumerate(windows)]

    def active_shape(self, shape: DecoderShape, layers: int) -> DecoderShape:
        """``shape`` with the MLP width a token uses, averaged over the layers (k experts plus the shared
        expert on sparse layers, ``intermediate_size`` on dense ones) and the router's outputs."""
        sparse = sum(self.moe_layer(i) for i in range(layers))
        shared = self.shared_expert_size()
        active = sparse * (self.num_experts_per_tok * self.moe_intermediate_size + shared)
        active += (layers - sparse) * shape.mlp_width
        router = sparse * (self.num_experts + (1 if shared else 0))
        return dataclasses.replace(shape, mlp_width=round(active / layers), router_width=round(router / layers))


class Qwen2MoeConfig(Qwen2Config, QwenMoeOptions):
    """Qwen2-MoE hyper-parameters, named as in HF's config.json: a shared expert of
    ``shared_expert_intermediate_size`` scaled by a sigmoid gate on every sparse layer, q/k/v biases
    (``qkv_bias``)."""

    name: Literal["qwen2_moe"] = "qwen2_moe"  # type: ignore[assignment]  # each family's own tag
    vocab_size: int = pydantic.Field(151936, gt=0)
    hidden_size: int = pydantic.Field(2048, gt=0)
    intermediate_size: int = pydantic.Field(5632, gt=0)
    num_hidden_layers: int = pydantic.Field(24, gt=0)
    num_attention_heads: int = pydantic.Field(16, gt=0)
    max_position_embeddings: int = pydantic.Field(32768, gt=0)
    shared_expert_intermediate_size: int = pydantic.Field(5632, gt=0)
    # HF's ``qkv_bias``, under another Python name: Llama's configs answer ``qkv_bias`` with a property.
    qkv_bias_: bool = pydantic.Field(True, alias="qkv_bias")

    model_config = pydantic.ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v carry a bias (HF's ``qkv_bias``)."""
        return self.qkv_bias_

    def shared_expert_size(self) -> int:
        """``shared_expert_intermediate_size``."""
        return self.shared_expert_intermediate_size

    def decoder_shape(self) -> DecoderShape:
        """Qwen2's shape with the active MLP width and the router (:meth:`QwenMoeOptions.active_shape`)."""
        return self.active_shape(super().decoder_shape(), self.num_hidden_layers)

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's window and whether it has experts."""
        return self.moe_layer_kinds(super().layer_kinds())


class Qwen3MoeConfig(Qwen3Config, QwenMoeOptions):
    """Qwen3-MoE hyper-parameters, named as in HF's config.json (no shared expert)."""

    name: Literal["qwen3_moe"] = "qwen3_moe"  # type: ignore[assignment]  # each family's own tag
    vocab_size: int = pydantic.Field(151936, gt=0)
    hidden_size: int = pydantic.Field(2048, gt=0)
    intermediate_size: int = pydantic.Field(6144, gt=0)
    num_hidden_layers: int = pydantic.Field(24, gt=0)
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = pydantic.Field(32768, gt=0)
    num_experts: int = pydantic.Field(128, gt=0)
    num_experts_per_tok: int = pydantic.Field(8, gt=0)
    moe_intermediate_size: int = pydantic.Field(768, gt=0)

    def decoder_shape(self) -> DecoderShape:
        """Qwen3's shape with the active MLP width and the router (:meth:`QwenMoeOptions.active_shape`)."""
        return self.active_shape(super().decoder_shape(), self.num_hidden_layers)

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's window and whether it has experts."""
        return self.moe_layer_kinds(super().layer_kinds())
