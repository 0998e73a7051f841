"""``model.name: deepseek_v3``: DeepSeek-V3 with HF's config.json keys (:mod:`functrain.models.deepseek_v3`).

Multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``) and DeepSeek's mixture of experts (:mod:`functrain.models.configs.deepseek_moe`: dense first
layers, sigmoid group-limited routing with a correction bias, shared experts, ``model.bias_update_rate``).
"""

from typing import Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.deepseek_moe import DeepseekMoeOptions
from functrain.models.configs.hf import HFModelConfig, check_activation
from functrain.models.configs.rope import RopeScaling
from functrain.models.family import Family


class DeepseekV3Config(DeepseekMoeOptions, HFModelConfig):
    """DeepSeek-V3 hyper-parameters, named as in HF's config.json (the defaults are the released model's), plus
    the MoE keys and options of :class:`DeepseekMoeOptions`."""

    name: Literal["deepseek_v3"] = "deepseek_v3"
    vocab_size: int = pydantic.Field(129280, gt=0)
    hidden_size: int = pydantic.Field(7168, gt=0)
    intermediate_size: int = pydantic.Field(18432, gt=0)
    num_hidden_layers: int = pydantic.Field(61, gt=0)
    num_attention_heads: int = pydantic.Field(128, gt=0)
    num_key_value_heads: int | None = None  # MLA expands keys and values per query head: HF needs it equal
    kv_lora_rank: int = pydantic.Field(512, gt=0)
    q_lora_rank: int | None = pydantic.Field(1536, gt=0)
    qk_rope_head_dim: int = pydantic.Field(64, gt=0)
    v_head_dim: int = pydantic.Field(128, gt=0)
    qk_nope_head_dim: int = pydantic.Field(128, ge=0)
    hidden_act: str = "silu"
    max_position_embeddings: int = pydantic.Field(4096, gt=0)
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_interleave: bool = True  # DeepSeek's rotary pairs are adjacent (x0, x1), not the two halves
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.num_key_value_heads not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_key_value_heads {self.num_key_value_heads} must equal num_attention_heads "
                f"{self.num_attention_heads} (latent attention has a key and a value per query head)"
            )
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even for rotary embeddings")
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

    def decoder_shape(self) -> DecoderShape:
        """Latent attention's projections (queries through ``q_lora_rank`` when set, keys and values through
        ``kv_lora_rank`` plus the shared rotary key, the output), and the MLP width a token uses averaged over the
        layers (:meth:`DeepseekMoeOptions.active_mlp`). The multi-token-prediction layers
        (``num_nextn_predict_layers``) are left out: not counted in the plan's parameters or FLOPs."""
        d, heads = self.hidden_size, self.num_attention_heads
        queries = heads * self.qk_head_dim
        query_params = d * queries if self.q_lora_rank is None else self.q_lora_rank * (d + queries)
        key_value_params = d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        mlp_width, router_width = self.active_mlp(self.intermediate_size)
        return DecoderShape(
            layers=self.num_hidden_layers,
            width=d,
            heads=heads,
            kv_heads=heads,
            head_dim=self.qk_head_dim,
            mlp_width=mlp_width,
            mlp_matrices=3,
            vocab=self.vocab_size,
            router_width=router_width,
            attention_params=query_params + key_value_params + heads * self.v_head_dim * d,
            value_head_dim=self.v_head_dim,
        )

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size


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
    hf_mapping="torch_bridge.hf.deepseek_mappings:DEEPSEEK_V3",
)
