"""DeepSeek's mixture of experts as config keys, shared by DeepSeek-V3 and GLM-4.5 (``glm4_moe``): the first
``first_k_dense_replace`` layers with a dense SwiGLU MLP of ``intermediate_size``, the others ``n_routed_experts``
experts of ``moe_intermediate_size`` (sigmoid scores plus a per-expert correction bias choose the top
``num_experts_per_tok`` within the best ``topk_group`` of ``n_group`` groups, weights renormalised with
``norm_topk_prob`` and scaled by ``routed_scaling_factor``) plus ``n_shared_experts`` always on
(:mod:`functrain.models.deepseek_v3`, :mod:`functrain.models.deepseek_routing`).

``model.bias_update_rate`` (not an HF key; 0: off) turns on DeepSeek's auxiliary-loss-free balancing: after every
training step each expert's ``e_score_correction_bias`` moves by that rate towards its layer's mean load.

``num_nextn_predict_layers`` (HF's key; 0: off) adds DeepSeek's multi-token prediction of that depth
(:mod:`functrain.models.mtp`), trained with the weight ``model.mtp_loss_weight`` (not an HF key).
"""

from typing import ClassVar, Hashable

import pydantic

from functrain.models.configs.moe import MoeOptions

# The keys these families add that no HF config.json has (left out of exported configs).
DEEPSEEK_RUNTIME_KEYS = frozenset({"bias_update_rate", "mtp_loss_weight"})


class DeepseekMoeOptions(MoeOptions):
    """The MoE keys of DeepSeek-V3 and GLM-4.5 (defaults: DeepSeek-V3's), mixed in before the family's config,
    plus the options of :class:`MoeOptions` and ``bias_update_rate``."""

    moe_intermediate_size: int = pydantic.Field(2048, gt=0)
    n_shared_experts: int = pydantic.Field(1, ge=0)
    n_routed_experts: int = pydantic.Field(256, gt=0)
    routed_scaling_factor: float = 2.5
    n_group: int = pydantic.Field(8, gt=0)
    topk_group: int = pydantic.Field(4, gt=0)
    num_experts_per_tok: int = pydantic.Field(8, gt=0)
    first_k_dense_replace: int = pydantic.Field(3, ge=0)
    norm_topk_prob: bool = True
    bias_update_rate: float = pydantic.Field(0.0, ge=0)  # DeepSeek's gamma (0.001 in its report); 0: no update
    num_nextn_predict_layers: int = pydantic.Field(0, ge=0)  # multi-token prediction's depth D; 0: none
    # Its loss's weight (DeepSeek's lambda: 0.3, then 0.1 for the last third of the tokens); 0: the MTP layers kept
    # (converted, exported) but not run.
    mtp_loss_weight: float = pydantic.Field(0.1, ge=0)

    expert_count_key: ClassVar[str] = "n_routed_experts"
    num_hidden_layers: int  # the family's

    @pydantic.model_validator(mode="after")
    def _groups_fit(self):
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not a multiple of n_group {self.n_group}")
        if self.n_routed_experts // self.n_group < 2:
            raise ValueError(
                f"n_group {self.n_group} leaves fewer than 2 experts a group (a group scores by its best two)"
            )
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} is more than n_group {self.n_group}")
        selectable = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > selectable:
            raise ValueError(
                f"num_experts_per_tok {self.num_experts_per_tok} is more than the {selectable} experts of the "
                f"topk_group {self.topk_group} groups a token may pick from"
            )
        return self

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has the mixture of experts (every layer from ``first_k_dense_replace`` on)."""
        return layer >= self.first_k_dense_replace

    def expert_count(self) -> int:
        """``n_routed_experts`` (the shared experts are always on, not routed)."""
        return self.n_routed_experts

    def experts_per_token(self) -> int:
        """``num_experts_per_tok``."""
        return self.num_experts_per_tok

    def balancing_coefficient(self) -> float:
        """0: these models balance by their correction bias (``bias_update_rate``), transformers adds no
        auxiliary loss (``model.router_z_loss_coef`` still applies when set)."""
        return 0.0

    def mtp_layers(self) -> list[int]:
        """The HF layer indices of the multi-token-prediction modules (those past ``num_hidden_layers``)."""
        return list(range(self.num_hidden_layers, self.num_hidden_layers + self.num_nextn_predict_layers))

    @property
    def mtp_trained(self) -> bool:
        """Whether the forward runs the multi-token-prediction layers and adds their loss."""
        return bool(self.num_nextn_predict_layers) and self.mtp_loss_weight > 0

    @property
    def dense_layers(self) -> int:
        """How many layers (the first ones) have a dense MLP."""
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    def active_mlp(self, dense_width: int) -> tuple[int, int]:
        """(the MLP width a token uses, the router's outputs), averaged over the layers: ``dense_width`` on the
        dense layers, ``k`` routed experts and the shared ones of ``moe_intermediate_size`` on the others."""
        layers = self.num_hidden_layers
        sparse = layers - self.dense_layers
        active = sparse * (self.num_experts_per_tok + self.n_shared_experts) * self.moe_intermediate_size
        active += self.dense_layers * dense_width
        return round(active / layers), round(sparse * self.n_routed_experts / layers)

    def layer_kinds(self) -> list[Hashable]:
        """``dense`` for the first ``first_k_dense_replace`` layers, ``moe`` after (the module scans each run of
        layers as its own stack)."""
        return ["moe" if self.moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    def pipelined_layer_kinds(self) -> list[Hashable]:
        """The MoE layers: every pipeline stage runs the dense first layers whole."""
        return [kind for kind in self.layer_kinds() if kind == "moe"]
