"""``model.name: qwen3_next``: Gated DeltaNet layers (``linear_attention``) and gated full attention in a repeating
pattern, a mixture of experts with a shared expert (:mod:`functrain.models.qwen3_next`); and the base of Qwen3.5's
configs (:mod:`functrain.models.configs.qwen3_5_text`, :mod:`functrain.models.configs.qwen3_5_moe_text`)."""

from typing import ClassVar, Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, check_activation
from functrain.models.configs.qwen_moe import QwenMoeOptions
from functrain.models.configs.rope import RopeScaling
from functrain.models.family import Family

HybridLayerType = Literal["linear_attention", "full_attention"]
GdnKernel = Literal["xla", "pallas"]  # the chunked delta rule's kernel (functrain.models.delta_rule_pallas)
FULL_ATTENTION_INTERVAL = 4  # transformers' default pattern: three Gated DeltaNet layers, then one full attention


def delta_rule_flops(chunk: int, key_dim: int, value_dim: int) -> float:
    """Forward FLOPs per token and value head of the chunked gated delta rule
    (:func:`functrain.models.delta_rule.chunked_delta_rule`): the chunk's two [C, C] score products, its block inverse
    (padded to a power of two) and that inverse times values and keys, and the four products with the state."""
    padded = 1 << (chunk - 1).bit_length()
    inverse = 2 * padded * (padded**2 - 1) / 3
    scores = 2 * (2 * chunk * chunk * key_dim + chunk * chunk * (key_dim + value_dim))
    state = 2 * (3 * chunk * key_dim * value_dim + chunk * chunk * value_dim)
    return (scores + inverse + state) / chunk


class HybridConfig(HFModelConfig):
    """What Qwen3-Next and Qwen3.5 share, named as in HF's config.json (the rope's ``partial_rotary_factor`` and
    M-RoPE settings as fields of their own), and functrain's keys of the delta rule (no part of an HF config.json):
    ``linear_chunk_size``, its tokens per chunk, and ``gdn_kernel``, ``xla`` or ``pallas`` (the TPU kernels,
    forward and backward, of :mod:`functrain.models.delta_rule_pallas`; the same maths)."""

    vocab_size: int = pydantic.Field(151936, gt=0)
    hidden_size: int = pydantic.Field(2048, gt=0)
    num_hidden_layers: int = pydantic.Field(48, gt=0)
    num_attention_heads: int = pydantic.Field(16, gt=0)
    num_key_value_heads: int = pydantic.Field(2, gt=0)
    head_dim: int = pydantic.Field(256, gt=0)
    hidden_act: str = "silu"
    max_position_embeddings: int = pydantic.Field(32768, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    partial_rotary_factor: float = pydantic.Field(0.25, gt=0, le=1)
    # Qwen3.5's M-RoPE: text alone has one position per token on all three axes, where it is plain RoPE; kept so that
    # an export writes them back.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    linear_conv_kernel_dim: int = pydantic.Field(4, gt=0)
    linear_key_head_dim: int = pydantic.Field(128, gt=0)
    linear_value_head_dim: int = pydantic.Field(128, gt=0)
    linear_num_key_heads: int = pydantic.Field(16, gt=0)
    linear_num_value_heads: int = pydantic.Field(32, gt=0)
    layer_types: tuple[HybridLayerType, ...] | None = None  # None: every 4th layer full attention
    linear_chunk_size: int = pydantic.Field(64, gt=0)
    gdn_kernel: GdnKernel = "xla"

    mlp_bias: ClassVar[bool] = False  # what Llama's MLP reads
    fused_linear_projections: ClassVar[bool] = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} gives "
                f"{self.rotary_dim} rotary dimensions; rotary embeddings need a positive even number"
            )
        check_activation(self.hidden_act)
        return self

    @property
    def kv_heads(self) -> int:
        """``num_key_value_heads``."""
        return self.num_key_value_heads

    @property
    def attn_head_dim(self) -> int:
        """The full-attention layers' head width (``head_dim``)."""
        return self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each query and key head that RoPE rotates (transformers' rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, layer: int) -> HybridLayerType:
        """``layer_types[layer]``, by default ``linear_attention`` but on every 4th layer."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return "full_attention" if (layer + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's type (what a scan groups layers by: three Gated DeltaNet layers and one full attention)."""
        return [self.layer_type(i) for i in range(self.num_hidden_layers)]

    def hybrid_shape(self, mlp_width: int) -> DecoderShape:
        """The shape for the FLOPs formula with a gated MLP of ``mlp_width``: the full-attention layers' heads (their
        query projection twice as wide, for the output gate), the projections' parameters averaged over the layers,
        and the delta rule and convolution of the Gated DeltaNet layers as their mixing FLOPs."""
        layers, width = self.num_hidden_layers, self.hidden_size
        full = sum(self.layer_type(i) == "full_attention" for i in range(layers))
        heads, head_dim = self.num_attention_heads, self.head_dim
        attention = width * heads * head_dim * 3 + 2 * width * self.kv_heads * head_dim
        keys = self.linear_num_key_heads * self.linear_key_head_dim
        values, value_heads = self.linear_num_value_heads * self.linear_value_head_dim, self.linear_num_value_heads
        channels = 2 * keys + values
        linear = width * (channels + values + 2 * value_heads) + values * width
        rule = delta_rule_flops(self.linear_chunk_size, self.linear_key_head_dim, self.linear_value_head_dim)
        mixing = value_heads * rule + 2 * self.linear_conv_kernel_dim * channels
        return DecoderShape(
            layers=layers,
            width=width,
            heads=heads,
            kv_heads=self.kv_heads,
            head_dim=head_dim,
            mlp_width=mlp_width,
            mlp_matrices=3,
            vocab=self.vocab_size,
            attention_params=round((full * attention + (layers - full) * linear) / layers),
            attention_layers=full,
            mixer_flops=(layers - full) * mixing,
        )


class Qwen3NextConfig(HybridConfig, QwenMoeOptions):
    """Qwen3-Next hyper-parameters, named as in HF's config.json: experts on the layers ``decoder_sparse_step`` and
    ``mlp_only_layers`` leave sparse, each with a shared expert scaled by a sigmoid gate."""

    name: Literal["qwen3_next"] = "qwen3_next"
    intermediate_size: int = pydantic.Field(5632, gt=0)  # the dense layers' MLP width
    num_experts: int = pydantic.Field(512, gt=0)
    num_experts_per_tok: int = pydantic.Field(10, gt=0)
    moe_intermediate_size: int = pydantic.Field(512, gt=0)
    shared_expert_intermediate_size: int = pydantic.Field(512, gt=0)
    norm_topk_prob: bool = True

    fused_linear_projections: ClassVar[bool] = True

    def shared_expert_size(self) -> int:
        """``shared_expert_intermediate_size``."""
        return self.shared_expert_intermediate_size

    def decoder_shape(self) -> DecoderShape:
        """The hybrid's shape with the active MLP width and the router (:meth:`QwenMoeOptions.active_shape`)."""
        return self.active_shape(self.hybrid_shape(self.intermediate_size), self.num_hidden_layers)

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's type and whether it has experts."""
        return self.moe_layer_kinds(super().layer_kinds())


FAMILY = Family(
    name="qwen3_next",
    config=Qwen3NextConfig,
    code="functrain.models.qwen3_next",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,
    pipeline=False,
    generation_cache=True,
    hf_model_types=("qwen3_next",),
    hf_mapping="torch_bridge.hf.hybrid_mappings:QWEN3_NEXT",
)
