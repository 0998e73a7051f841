"""``model.name: gemma2``: Gemma 2 with HF's config.json keys (:mod:`functrain.models.gemma2`), the base of
Gemma 3's config."""

from typing import Any, ClassVar, Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, LayerType, check_activation
from functrain.models.configs.rope import RopeScaling
from functrain.models.family import Family


class Gemma2Config(HFModelConfig):
    """Gemma 2 hyper-parameters, named as in HF's config.json."""

    name: Literal["gemma2"] = "gemma2"
    vocab_size: int = pydantic.Field(256000, gt=0)
    hidden_size: int = pydantic.Field(2304, gt=0)
    intermediate_size: int = pydantic.Field(9216, gt=0)
    num_hidden_layers: int = pydantic.Field(26, gt=0)
    num_attention_heads: int = pydantic.Field(8, gt=0)
    num_key_value_heads: int = pydantic.Field(4, gt=0)
    head_dim: int = pydantic.Field(256, gt=0)
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = pydantic.Field(8192, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    query_pre_attn_scalar: int = pydantic.Field(256, gt=0)
    sliding_window: int | None = pydantic.Field(4096, gt=0)
    layer_types: tuple[LayerType, ...] | None = None
    attn_logit_softcapping: float | None = pydantic.Field(50.0, gt=0)
    final_logit_softcapping: float | None = pydantic.Field(30.0, gt=0)
    tie_word_embeddings: Literal[True] = True
    initializer_range: float = 0.02

    @pydantic.model_validator(mode="after")
    def _consistent(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        check_activation(self.hidden_activation)
        return self

    @property
    def attn_head_dim(self) -> int:
        """Per-head width (``head_dim``)."""
        return self.head_dim

    # Llama's MLP reads these: Gemma's gated MLP has no biases, its activation is ``hidden_activation``.
    mlp_bias: ClassVar[bool] = False

    @property
    def hidden_act(self) -> str:
        """The MLP's activation (``hidden_activation``), under the name Llama's MLP reads."""
        return self.hidden_activation

    # What Gemma 3 changes, overridden by its config subclass (functrain.models.configs.gemma3).
    sliding_window_pattern: ClassVar[int] = 2  # default layer_types: every n-th layer global, the others sliding

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on ``sliding_attention`` layers (by default all but every n-th), else None."""
        types = self.layer_types or tuple(
            "full_attention" if (i + 1) % self.sliding_window_pattern == 0 else "sliding_attention"
            for i in range(self.num_hidden_layers)
        )
        return self.sliding_window if types[layer] == "sliding_attention" else None

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head (``q_norm``/``k_norm``)."""
        return False

    def rope_for(self, layer: int) -> Any:
        """The rope settings (``rope_theta``, ``rope_scaling``) of ``layer``: the same on every Gemma 2 layer."""
        return self

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def decoder_shape(self) -> DecoderShape:
        """Grouped-query attention and a gated (three-matrix, GeGLU) MLP of width ``intermediate_size``."""
        return DecoderShape(
            layers=self.num_hidden_layers,
            width=self.hidden_size,
            heads=self.num_attention_heads,
            kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            mlp_width=self.intermediate_size,
            mlp_matrices=3,
            vocab=self.vocab_size,
        )

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's attention window (which decides its RoPE too, on Gemma 3)."""
        return [self.attention_window(i) for i in range(self.num_hidden_layers)]


FAMILY = Family(
    name="gemma2",
    config=Gemma2Config,
    code="functrain.models.gemma2",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("gemma2",),
    hf_mapping="torch_bridge.hf.mappings:GEMMA2",
)
