"""What every mixture-of-experts family's config adds (:mod:`functrain.models.moe`): how many experts, how many
a token takes, the balancing losses, and the options that are no part of an HF config.json.

The HF keys differ by family (Mixtral's ``num_local_experts``, Qwen's ``num_experts``), so each family names its
own fields and answers :meth:`MoeOptions.expert_count` / :meth:`MoeOptions.experts_per_token`; the options below
(``model.load_balance_scope``, ``model.capacity_factor``, ``model.router_z_loss_coef``, ``model.moe_dispatch``)
are the same keys everywhere.
"""

import dataclasses
from typing import ClassVar, Literal

import pydantic

from functrain.models.configs.base import DecoderShape

# Whose tokens count an expert's load in the balancing loss: each forward's own (transformers'), or the whole
# global batch's (every device and micro-batch; Qwen's "Demons in the Detail", what Qwen3-MoE trained with).
LoadBalanceScope = Literal["micro_batch", "global_batch"]
# How the experts run: tokens sorted by expert into a grouped matmul, or every expert on every token (weighted).
MoeDispatch = Literal["grouped", "dense"]

# The MoE keys no HF config.json has (left out of exported configs).
MOE_RUNTIME_KEYS = frozenset({"load_balance_scope", "capacity_factor", "router_z_loss_coef", "moe_dispatch"})


class MoeOptions(pydantic.BaseModel):
    """The MoE options every family shares; a family mixes it into its config and names its expert counts."""

    load_balance_scope: LoadBalanceScope = "micro_batch"
    capacity_factor: float | None = pydantic.Field(None, gt=0)  # None: dropless
    router_z_loss_coef: float = pydantic.Field(0.0, ge=0)
    moe_dispatch: MoeDispatch = "grouped"

    # The HF keys of the two counts, for messages.
    expert_count_key: ClassVar[str] = "num_experts"
    top_k_key: ClassVar[str] = "num_experts_per_tok"

    def expert_count(self) -> int:
        """The routed experts of each MoE layer."""
        raise NotImplementedError

    def experts_per_token(self) -> int:
        """How many routed experts each token takes (top-k)."""
        raise NotImplementedError

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has experts (else a dense MLP); every layer unless the family says otherwise."""
        return True

    def balancing_coefficient(self) -> float:
        """What the auxiliary load-balancing loss is multiplied by in the training loss: ``router_aux_loss_coef``
        when ``output_router_logits`` is true (transformers' rule), else 0."""
        raise NotImplementedError

    @pydantic.model_validator(mode="after")
    def _top_k_fits(self):
        if self.experts_per_token() > self.expert_count():
            raise ValueError(
                f"{self.top_k_key} {self.experts_per_token()} is above {self.expert_count_key} "
                f"{self.expert_count()}; a token can take at most {self.expert_count()} experts"
            )
        return self


class LocalExperts(MoeOptions):
    """The MoE keys Mixtral and GPT-OSS share (``num_local_experts``, ``num_experts_per_tok``, transformers'
    balancing switch and coefficient): mixed in before the attention family's config, whose decoder shape it
    narrows to the active experts. A family sets its own defaults by redeclaring the fields."""

    intermediate_size: int = pydantic.Field(14336, gt=0)  # each expert's width
    num_local_experts: int = pydantic.Field(8, gt=0)
    num_experts_per_tok: int = pydantic.Field(2, gt=0)
    output_router_logits: bool = False
    router_aux_loss_coef: float = pydantic.Field(0.001, ge=0)

    expert_count_key: ClassVar[str] = "num_local_experts"

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
        """The attention family's shape with the active experts' width (``k x intermediate_size``) and the
        router."""
        shape = super().decoder_shape()  # type: ignore[misc]  # the attention family's, next in the MRO
        return dataclasses.replace(
            shape,
            mlp_width=self.num_experts_per_tok * self.intermediate_size,
            router_width=self.num_local_experts,
        )
