"""``model.name: gemma4``: Gemma 4's language model (HF ``gemma4_text``): sliding and global layers, the global ones
with their own head width and key/value heads, per-layer input embeddings, keys that double as values on the global
layers (``attention_k_eq_v``), an optional mixture of experts beside every MLP, a rope per layer type, and last layers
that reuse the keys and values of an earlier layer of their type (``num_kv_shared_layers``, Gemma 4 E2B/E4B)
(:mod:`functrain.models.gemma4`)."""

from typing import ClassVar, Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, LayerType, check_activation
from functrain.models.configs.moe import MoeOptions
from functrain.models.configs.rope import RopeScaling, RopeSettings
from functrain.models.family import Family

SLIDING_PATTERN = 6  # transformers' default layer_types: five sliding layers, then a global one
LAYER_PREFIX, KV_SHARED_PREFIX = "layers_", "kv_shared_layers_"  # the module names of the two runs of layers


class Gemma4Rope(pydantic.BaseModel):
    """One layer type's rotary embedding: ``rope_theta`` with an HF ``rope_scaling``, or (``proportional``)
    transformers' proportional rope, which turns the leading ``partial_rotary_factor`` of a head's frequencies (the
    rest keep a zero frequency) and divides them by ``factor``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rope_theta: float = pydantic.Field(gt=0)
    rope_scaling: RopeScaling | None = None
    proportional: bool = False
    partial_rotary_factor: float = pydantic.Field(1.0, gt=0, le=1)
    factor: float = pydantic.Field(1.0, gt=0)  # proportional's divisor of the frequencies


class Gemma4TextConfig(MoeOptions, HFModelConfig):
    """Gemma 4 (text) hyper-parameters, named as in HF's config.json (the defaults are transformers'), except: the
    rope of each layer type is ``sliding_rope`` / ``full_rope`` (HF nests them in ``rope_parameters``), and
    ``layer_head_dims`` / ``layer_kv_heads`` spell out every layer's head width and key/value heads (HF's sparse
    ``per_layer_config``; None: ``global_head_dim`` and, with ``attention_k_eq_v``, ``num_global_key_value_heads`` on
    the global layers, as transformers derives them)."""

    name: Literal["gemma4"] = "gemma4"
    vocab_size: int = pydantic.Field(262144, gt=0)
    hidden_size: int = pydantic.Field(2304, gt=0)
    intermediate_size: int = pydantic.Field(9216, gt=0)
    num_hidden_layers: int = pydantic.Field(30, gt=0)
    num_attention_heads: int = pydantic.Field(8, gt=0)
    num_key_value_heads: int = pydantic.Field(4, gt=0)
    head_dim: int = pydantic.Field(256, gt=0)
    global_head_dim: int = pydantic.Field(512, gt=0)
    num_global_key_value_heads: int | None = pydantic.Field(None, gt=0)
    layer_head_dims: tuple[int, ...] | None = None
    layer_kv_heads: tuple[int, ...] | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = pydantic.Field(131072, gt=0)
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    sliding_window: int = pydantic.Field(512, gt=0)
    layer_types: tuple[LayerType, ...] | None = None
    sliding_rope: Gemma4Rope = Gemma4Rope(rope_theta=10000.0)
    full_rope: Gemma4Rope = Gemma4Rope(rope_theta=1000000.0, proportional=True, partial_rotary_factor=0.25)
    final_logit_softcapping: float | None = pydantic.Field(None, gt=0)
    vocab_size_per_layer_input: int = pydantic.Field(262144, gt=0)
    hidden_size_per_layer_input: int = pydantic.Field(256, ge=0)  # 0: no per-layer inputs
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = pydantic.Field(0, ge=0)  # the last layers, which reuse earlier layers' keys/values
    use_double_wide_mlp: bool = False  # the MLPs of the layers sharing keys/values twice intermediate_size wide
    enable_moe_block: bool = False
    num_experts: int | None = pydantic.Field(None, gt=0)
    top_k_experts: int | None = pydantic.Field(None, gt=0)
    moe_intermediate_size: int | None = pydantic.Field(None, gt=0)

    expert_count_key: ClassVar[str] = "num_experts"
    top_k_key: ClassVar[str] = "top_k_experts"
    # Llama's MLP reads these: Gemma's gated MLP has no biases, its activation is ``hidden_activation``.
    mlp_bias: ClassVar[bool] = False

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        layers = self.num_hidden_layers
        check_activation(self.hidden_activation)
        for key in ("layer_types", "layer_head_dims", "layer_kv_heads"):
            value = getattr(self, key)
            if value is not None and len(value) != layers:
                raise ValueError(f"{key} has {len(value)} entries for {layers} layers")
        uneven = [kv for kv in map(self.kv_heads_of, range(layers)) if self.num_attention_heads % kv]
        if uneven:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of {uneven[0]} "
                             f"key/value heads")  # fmt: skip
        self._check_shared_keys_and_values()
        if self.enable_moe_block and None in (self.num_experts, self.top_k_experts, self.moe_intermediate_size):
            raise ValueError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size; set them")
        return self

    def _check_shared_keys_and_values(self) -> None:
        """Each layer sharing keys and values has an earlier layer of its type whose heads match its own."""
        for layer in range(self.first_kv_shared_layer, self.num_hidden_layers):
            source = self.kv_source(layer)
            if source is None:
                raise ValueError(f"num_kv_shared_layers {self.num_kv_shared_layers} leaves no earlier "
                                 f"{self.resolved_layer_types()[layer]} layer to compute layer {layer}'s keys and "
                                 f"values; lower num_kv_shared_layers")  # fmt: skip
            mine = (self.head_dim_of(layer), self.kv_heads_of(layer))
            theirs = (self.head_dim_of(source), self.kv_heads_of(source))
            if mine != theirs:
                raise ValueError(f"layer {layer} reuses layer {source}'s keys and values but its (head_dim, "
                                 f"num_key_value_heads) {mine} differ from that layer's {theirs}; make them "
                                 f"equal")  # fmt: skip

    @property
    def first_kv_shared_layer(self) -> int:
        """The first layer that reuses an earlier layer's keys and values (``num_hidden_layers`` when none does)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_shared(self, layer: int) -> bool:
        """Whether ``layer`` reuses an earlier layer's keys and values (it has no key/value projections)."""
        return layer >= self.first_kv_shared_layer

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values ``layer`` attends to: the last layer of its type before the shared ones
        (transformers' ``kv_sharing_modes``), ``layer`` itself when it computes its own, None when there is none."""
        if not self.kv_shared(layer):
            return layer
        types = self.resolved_layer_types()
        return next((i for i in reversed(range(self.first_kv_shared_layer)) if types[i] == types[layer]), None)

    def kv_stored(self, layer: int) -> bool:
        """Whether a later layer reuses ``layer``'s keys and values."""
        return any(self.kv_source(i) == layer for i in range(self.first_kv_shared_layer, self.num_hidden_layers))

    def mlp_width_of(self, layer: int) -> int:
        """The MLP's width: ``intermediate_size``, twice it on the layers sharing keys and values with
        ``use_double_wide_mlp``."""
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.kv_shared(layer) else 1)

    def layer_name(self, layer: int) -> str:
        """The module of ``layer``: ``layers_{i}``, ``kv_shared_layers_{j}`` for the j-th layer sharing keys and
        values (a run of layers of its own, which a scan stacks apart from the others)."""
        if self.kv_shared(layer):
            return f"{KV_SHARED_PREFIX}{layer - self.first_kv_shared_layer}"
        return f"{LAYER_PREFIX}{layer}"

    @property
    def hidden_act(self) -> str:
        """The MLP's activation (``hidden_activation``), under the name Llama's MLP reads."""
        return self.hidden_activation

    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types`` (or five sliding layers to a global one), the last layer global as transformers forces."""
        types = self.layer_types or tuple(
            "sliding_attention" if (i + 1) % SLIDING_PATTERN else "full_attention"
            for i in range(self.num_hidden_layers)
        )
        return (*types[:-1], "full_attention")

    def is_global(self, layer: int) -> bool:
        """Whether ``layer`` attends to the whole context (a ``full_attention`` layer)."""
        return self.resolved_layer_types()[layer] == "full_attention"

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on sliding layers, None on global ones."""
        return None if self.is_global(layer) else self.sliding_window

    def head_dim_of(self, layer: int) -> int:
        """The head width of ``layer``: ``layer_head_dims``, or ``global_head_dim`` on global layers."""
        if self.layer_head_dims is not None:
            return self.layer_head_dims[layer]
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """The key/value heads of ``layer``: ``layer_kv_heads``, or ``num_global_key_value_heads`` on global layers
        with ``attention_k_eq_v`` (transformers' derivation)."""
        if self.layer_kv_heads is not None:
            return self.layer_kv_heads[layer]
        if self.is_global(layer) and self.attention_k_eq_v and self.num_global_key_value_heads is not None:
            return self.num_global_key_value_heads
        return self.num_key_value_heads

    def values_are_keys(self, layer: int) -> bool:
        """Whether ``layer``'s values are its key projection (``attention_k_eq_v`` on a global layer)."""
        return self.attention_k_eq_v and self.is_global(layer)

    def rope_of(self, layer: int) -> tuple[Gemma4Rope, RopeSettings]:
        """The layer type's rope and what :func:`functrain.models.rope.frequencies` reads for it."""
        rope = self.full_rope if self.is_global(layer) else self.sliding_rope
        return rope, RopeSettings(
            rope.rope_theta, rope.rope_scaling, self.head_dim_of(layer), self.max_position_embeddings
        )

    @property
    def per_layer_inputs(self) -> bool:
        """Whether the layers take per-layer input embeddings (``hidden_size_per_layer_input`` > 0)."""
        return self.hidden_size_per_layer_input > 0

    def expert_count(self) -> int:
        """``num_experts`` (0 without the MoE block)."""
        return (self.num_experts or 0) if self.enable_moe_block else 0

    def experts_per_token(self) -> int:
        """``top_k_experts`` (0 without the MoE block)."""
        return (self.top_k_experts or 0) if self.enable_moe_block else 0

    def moe_layer(self, layer: int) -> bool:
        """Every layer has the experts beside its MLP with ``enable_moe_block``, none without."""
        return self.enable_moe_block

    def balancing_coefficient(self) -> float:
        """0: transformers trains Gemma 4 without a balancing loss."""
        return 0.0

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """The ids both tables embed: ``vocab_size``, or ``vocab_size_per_layer_input`` with per-layer inputs when
        it is smaller (transformers looks every id up in both)."""
        return min(self.vocab_size, self.vocab_size_per_layer_input) if self.per_layer_inputs else self.vocab_size

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's window, head width and key/value heads (its rope follows its window), and whether it shares
        keys and values: what a scan groups."""
        return [(self.attention_window(i), self.head_dim_of(i), self.kv_heads_of(i), self.kv_shared(i)) for i in range(
            self.num_hidden_layers)]  # fmt: skip

    def decoder_shape(self) -> DecoderShape:
        """Grouped-query attention (the layers' mean head width), the GeGLU MLP (the layers' mean width) plus, with
        the MoE block, the active experts' width, and the router."""
        layers = self.num_hidden_layers
        experts = self.experts_per_token() * (self.moe_intermediate_size or 0)
        return DecoderShape(
            layers=layers,
            width=self.hidden_size,
            heads=self.num_attention_heads,
            kv_heads=round(sum(map(self.kv_heads_of, range(layers))) / layers),
            head_dim=round(sum(map(self.head_dim_of, range(layers))) / layers),
            mlp_width=round(sum(map(self.mlp_width_of, range(layers))) / layers) + experts,
            mlp_matrices=3,
            vocab=self.vocab_size,
            router_width=self.expert_count(),
        )


FAMILY = Family(
    name="gemma4",
    config=Gemma4TextConfig,
    code="functrain.models.gemma4",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,  # sliding windows are not split over the context axis (as Gemma 2/3)
    pipeline=False,  # the per-layer inputs ride beside the scan, which pipeline stages do not split
    generation_cache=True,
    hf_model_types=("gemma4_text",),
    hf_mapping="torch_bridge.hf.gemma4_mappings:GEMMA4",
)
