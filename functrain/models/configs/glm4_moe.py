"""``model.name: glm4_moe``: GLM-4.5, DeepSeek's mixture of experts (:mod:`functrain.models.configs.deepseek_moe`)
under grouped-query attention whose heads rotate only their leading ``partial_rotary_factor`` share of features,
with optional per-head query/key RMSNorm (``use_qk_norm``) (:mod:`functrain.models.glm4_moe`)."""

import dataclasses
from typing import Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.deepseek_moe import DeepseekMoeOptions
from functrain.models.configs.llama import LlamaConfig
from functrain.models.configs.rope import RopeSettings
from functrain.models.family import Family


class Glm4MoeConfig(DeepseekMoeOptions, LlamaConfig):
    """GLM-4.5 hyper-parameters, named as in HF's config.json: transformers' defaults (GLM-4.5-Air's sizes) with
    the released ``head_dim`` of 128 (transformers' default derives it from ``hidden_size``)."""

    name: Literal["glm4_moe"] = "glm4_moe"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(151552, gt=0)
    hidden_size: int = pydantic.Field(4096, gt=0)
    intermediate_size: int = pydantic.Field(10944, gt=0)
    num_hidden_layers: int = pydantic.Field(46, gt=0)
    num_attention_heads: int = pydantic.Field(96, gt=0)
    num_key_value_heads: int | None = 8
    head_dim: int | None = pydantic.Field(128, gt=0)
    max_position_embeddings: int = pydantic.Field(131072, gt=0)
    rms_norm_eps: float = 1e-5
    mlp_bias: Literal[False] = False  # not an HF GLM key: its MLPs have no biases
    partial_rotary_factor: float = pydantic.Field(0.5, gt=0, le=1)
    use_qk_norm: bool = False
    moe_intermediate_size: int = pydantic.Field(1408, gt=0)
    n_routed_experts: int = pydantic.Field(128, gt=0)
    routed_scaling_factor: float = 1.0
    n_group: int = pydantic.Field(1, gt=0)
    topk_group: int = pydantic.Field(1, gt=0)
    first_k_dense_replace: int = pydantic.Field(1, ge=0)

    @pydantic.model_validator(mode="after")
    def _rotary_dim_even(self):
        if self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"head_dim {self.attn_head_dim} x partial_rotary_factor {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotated features; rotary embeddings need an even number above 0"
            )
        return self

    @property
    def rotary_dim(self) -> int:
        """The leading features of each query and key head that rotate (HF: ``int(head_dim * factor)``)."""
        return int(self.attn_head_dim * self.partial_rotary_factor)

    @property
    def qkv_bias(self) -> bool:
        """``attention_bias`` covers q, k and v."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """GLM's ``o_proj`` has no bias."""
        return False

    @property
    def qk_norm(self) -> bool:
        """``use_qk_norm``: RMSNorm over each query and key head."""
        return self.use_qk_norm

    def rope_for(self, layer: int) -> RopeSettings:
        """The config's rope over the leading ``rotary_dim`` features of each head."""
        return RopeSettings(self.rope_theta, self.rope_scaling, self.rotary_dim, self.max_position_embeddings)

    def decoder_shape(self) -> DecoderShape:
        """Grouped-query attention, and the MLP width a token uses averaged over the layers
        (:meth:`DeepseekMoeOptions.active_mlp`)."""
        mlp_width, router_width = self.active_mlp(self.intermediate_size)
        return dataclasses.replace(super().decoder_shape(), mlp_width=mlp_width, router_width=router_width)


FAMILY = Family(
    name="glm4_moe",
    config=Glm4MoeConfig,
    code="functrain.models.glm4_moe",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("glm4_moe",),
    hf_mapping="torch_bridge.hf.deepseek_mappings:GLM4_MOE",
)
