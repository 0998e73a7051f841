"""``model.name: deepseek_v3``: DeepSeek-V3 with HF's config.json keys (:mod:`functrain.models.deepseek_v3`).

Multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``), the first ``first_k_dense_replace`` layers with a dense SwiGLU MLP of ``intermediate_size``,
the others a mixture of ``n_routed_experts`` experts of ``moe_intermediate_size`` (sigmoid scores, top
``num_experts_per_tok`` within the best ``topk_group`` of ``n_group`` groups) plus ``n_shared_experts`` always on.

``model.bias_update_rate`` (not an HF key; 0: off) turns on DeepSeek's auxiliary-loss-free balancing: after every
training step each expert's ``e_score_correction_bias`` moves by that rate towards its layer's mean load
(:mod:`functrain.models.deepseek_routing`).
"""

from typing import ClassVar, Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, check_activation
from functrain.models.configs.moe import MoeOptions
from functrain.models.configs.rope import RopeScaling
from functrain.models.family import Family


class DeepseekV3Config(HFModelConfig, MoeOptions):
    """DeepSeek-V3 hyper-parameters, named as in HF's config.json (the defaults are the released model's), plus
    the MoE options of :class:`MoeOptions` and ``bias_update_rate``."""

    name: Literal["deepseek_v3"] = "deepseek_v3"
    vocab_size: int = pydantic.Field(129280, gt=0)
    hidden_size: int = pydantic.Field(7168, gt=0)
    intermediate_size: int = pydantic.Field(18432, gt=0)
    moe_intermediate_size: int = pydantic.Field(2048, gt=0)
    num_hidden_layers: int = pydantic.Field(61, gt=0)
    num_attention_heads: int = pydantic.Field(128, gt=0)
    num_key_value_heads: int | None = None  # MLA expands keys and values per query head: HF needs it equal
    n_shared_experts: int = pydantic.Field(1, ge=0)
    n_routed_experts: int = pydantic.Field(256, gt=0)
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = pydantic.Field(512, gt=0)
    q_lora_rank: int | None = pydantic.Field(1536, gt=0)
    qk_rope_head_dim: int = pydantic.Field(64, gt=0)
    v_head_dim: int = pydantic.Field(128, gt=0)
    qk_nope_head_dim: int = pydantic.Field(128, ge=0)
    n_group: int = pydantic.Field(8, gt=0)
    topk_group: int = pydantic.Field(4, gt=0)
    num_experts_per_tok: int = pydantic.Field(8, gt=0)
    first_k_dense_replace: int = pydantic.Field(3, ge=0)
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = pydantic.Field(4096, gt=0)
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True  # DeepSeek's rotary pairs are adjacent (x0, x1), not the two halves
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bias_update_rate: float = pydantic.Field(0.0, ge=0)  # DeepSeek's gamma (0.001 in its report); 0: no update

    expert_count_key: ClassVar[str] = "n_routed_experts"

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads "
                f"{self.num_attention_heads} (latent attention has a key and a value per query head)"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")
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
        check_activation(self.hidden_act)
        return self

    @property
    def qk_head_dim(self) -> int:
        """The width of a query and key head: the un-rotated part plus the rotated part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_head_dim(self) -> int:
        """The width RoPE rotates (what :mod:`functrain.models.rope` reads): ``qk_rope_head_dim``, as HF sets
        DeepSeek-V3's ``head_dim``."""
        return self.qk_rope_head_dim

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
        """0: DeepSeek-V3 balances by its correction bias (``bias_update_rate``), transformers adds no auxiliary
        loss (``model.router_z_loss_coef`` still applies when set)."""
        return 0.0

    def decoder_shape(self) -> DecoderShape:
        """Latent attention's projections (queries through ``q_lora_rank`` when set, keys and values through
        ``kv_lora_rank`` plus the shared rotary key, the output), and the MLP width a token uses averaged over the
        layers (``intermediate_size`` on the first ``first_k_dense_replace``, then ``k`` routed experts and the
        shared ones of ``moe_intermediate_size``, and the router). The multi-token-prediction layer is left out,
        as the model leaves it out."""
        d, heads, layers = self.hidden_size, self.num_attention_heads, self.num_hidden_layers
        queries = heads * self.qk_head_dim
        query_params = d * queries if self.q_lora_rank is None else self.q_lora_rank * (d + queries)
        key_value_params = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        sparse = layers - self.dense_layers
        active = sparse * (self.num_experts_per_tok + self.n_shared_experts) * self.moe_intermediate_size
        active += self.dense_layers * self.intermediate_size
        return DecoderShape(
            layers=layers,
            width=d,
            heads=heads,
            kv_heads=heads,
            head_dim=self.qk_head_dim,
            mlp_width=round(active / layers),
            mlp_matrices=3,
            vocab=self.vocab_size,
            router_width=round(sparse * self.n_routed_experts / layers),
            attention_params=query_params + key_value_params + heads * self.v_head_dim * d,
            value_head_dim=self.v_head_dim,
        )

    @property
    def dense_layers(self) -> int:
        """How many layers (the first ones) have a dense MLP."""
        return min(self.first_k_dense_replace, self.num_hidden_layers)

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def layer_kinds(self) -> list[Hashable]:
        """``dense`` for the first ``first_k_dense_replace`` layers, ``moe`` after (the module scans each run of
        layers as its own stack)."""
        return ["moe" if self.moe_layer(i) else "dense" for i in range(self.num_hidden_layers)]

    def pipelined_layer_kinds(self) -> list[Hashable]:
        """The MoE layers: every pipeline stage runs the dense first layers whole."""
        return [kind for kind in self.layer_kinds() if kind == "moe"]


FAMILY = Family(
    name="deepseek_v3",
    config=DeepseekV3Config,
    code="functrain.models.deepseek_v3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("deepseek_v3",),
    hf_mapping="torch_bridge.hf.mappings:DEEPSEEK_V3",
)
