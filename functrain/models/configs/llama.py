"""``model.name: llama``: Llama with HF's config.json keys (:mod:`functrain.models.llama`), the base of the
Llama-shaped families' configs (Mistral, Phi-3, Qwen2, Qwen3)."""

from typing import Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, check_activation
from functrain.models.configs.rope import RopeScaling, RopeSettings
from functrain.models.family import Family


class LlamaConfig(HFModelConfig):
    """Llama hyper-parameters, named as in HF's config.json."""

    name: Literal["llama"] = "llama"
    vocab_size: int = pydantic.Field(32000, gt=0)
    hidden_size: int = pydantic.Field(4096, gt=0)
    intermediate_size: int = pydantic.Field(11008, gt=0)
    num_hidden_layers: int = pydantic.Field(32, gt=0)
    num_attention_heads: int = pydantic.Field(32, gt=0)
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = pydantic.Field(2048, gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02

    @pydantic.model_validator(mode="after")
    def _consistent_heads(self):
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads")
        if self.attn_head_dim % 2:
            raise ValueError(f"head_dim {self.attn_head_dim} must be even for rotary embeddings")
        check_activation(self.hidden_act)
        return self

    @property
    def kv_heads(self) -> int:
        """Key/value heads (``num_key_value_heads``, defaulting to one per query head)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def attn_head_dim(self) -> int:
        """Per-head width: ``head_dim`` or ``hidden_size // num_attention_heads``."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    # What the Llama-shaped families (Qwen2/3, Mistral) change, overridden by their config subclasses.
    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry a bias."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether the output projection carries a bias."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head before RoPE (``q_norm``/``k_norm``)."""
        return False

    @property
    def attention_sinks(self) -> bool:
        """Whether each query head has a learned sink logit in its softmax (``self_attn.sinks``, GPT-OSS)."""
        return False

    @property
    def qk_norm_across_heads(self) -> bool:
        """Whether ``q_norm``/``k_norm`` normalise all heads' features together (OLMo 3) rather than each head's."""
        return False

    @property
    def post_norms(self) -> bool:
        """Whether each layer normalises its attention's and MLP's outputs (``post_attention_layernorm``,
        ``post_feedforward_layernorm``: OLMo 3) rather than their inputs (``input_layernorm``,
        ``post_attention_layernorm``)."""
        return False

    def attention_window(self, layer: int) -> int | None:
        """Sliding-window size of ``layer``'s attention (keys within the last ``window`` positions); None: full."""
        return None

    def rope_for(self, layer: int) -> "LlamaConfig | RopeSettings | None":
        """The rotary embedding of ``layer`` (what :func:`functrain.models.rope.frequencies` reads): the config's
        own on every layer; None where a layer has none (SmolLM3's NoPE layers)."""
        return self

    def max_positions(self) -> int:
        """``max_position_embeddings``."""
        return self.max_position_embeddings

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def decoder_shape(self) -> DecoderShape:
        """Grouped-query attention and a gated (three-matrix) MLP of width ``intermediate_size``."""
        return DecoderShape(
            layers=self.num_hidden_layers,
            width=self.hidden_size,
            heads=self.num_attention_heads,
            kv_heads=self.kv_heads,
            head_dim=self.attn_head_dim,
            mlp_width=self.intermediate_size,
            mlp_matrices=3,
            vocab=self.vocab_size,
        )

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's attention window."""
        return [self.attention_window(i) for i in range(self.num_hidden_layers)]


FAMILY = Family(
    name="llama",
    config=LlamaConfig,
    code="functrain.models.llama",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("llama",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
