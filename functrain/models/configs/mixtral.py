"""``model.name: mixtral``: Mistral's attention with a mixture of experts in every layer
(:mod:`functrain.models.mixtral`)."""

import dataclasses
from typing import ClassVar, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.mistral import MistralConfig
from functrain.models.configs.moe import MoeOptions


class MixtralConfig(MistralConfig, MoeOptions):
    """Mixtral hyper-parameters, named as in HF's config.json (``intermediate_size`` is each expert's width),
    plus the MoE options of :class:`MoeOptions`."""

    name: Literal["mixtral"] = "mixtral"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    intermediate_size: int = pydantic.Field(14336, gt=0)
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = pydantic.Field(4096 * 32, gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    num_local_experts: int = pydantic.Field(8, gt=0)
    num_experts_per_tok: int = pydantic.Field(2, gt=0)
    output_router_logits: bool = False
    router_aux_loss_coef: float = pydantic.Field(0.001, ge=0)
    router_jitter_noise: float = 0.0  # transformers' training-time input noise: only 0 (not implemented)

    expert_count_key: ClassVar[str] = "num_local_experts"

    @pydantic.field_validator("router_jitter_noise")
    @classmethod
    def _no_jitter(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"router_jitter_noise {value} is not implemented; set it to 0")
        return value

    def expert_count(self) -> int:
        """``num_local_experts``."""
        return self.num_local_experts

    def experts_per_token(self) -> int:
        """``num_experts_per_tok``."""
        return self.num_experts_per_tok

    def balancing_coefficient(self) -> float:
        """``router_aux_loss_coef`` with ``output_router_logits``, else 0 (transformers' rule)."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def decoder_shape(self) -> DecoderShape:
        """Mistral's shape with the active experts' width (``k x intermediate_size``) and the router."""
        return dataclasses.replace(
            super().decoder_shape(),
            mlp_width=self.num_experts_per_tok * self.intermediate_size,
            router_width=self.num_local_experts,
        )
