"""``model.name: gpt2``: GPT-2 with HF's config.json keys (:mod:`functrain.models.gpt2`)."""

from typing import Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.hf import HFModelConfig, check_activation
from functrain.models.family import Family


class GPT2Config(HFModelConfig):
    """GPT-2 hyper-parameters, named as in HF's config.json."""

    name: Literal["gpt2"] = "gpt2"
    vocab_size: int = pydantic.Field(50257, gt=0)
    n_positions: int = pydantic.Field(1024, gt=0)
    n_embd: int = pydantic.Field(768, gt=0)
    n_layer: int = pydantic.Field(12, gt=0)
    n_head: int = pydantic.Field(12, gt=0)
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: Literal[True] = True

    @pydantic.model_validator(mode="after")
    def _heads_divide_width(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        check_activation(self.activation_function)
        return self

    @property
    def inner_size(self) -> int:
        """MLP width: ``n_inner`` or 4 × ``n_embd`` as in HF."""
        return self.n_inner or 4 * self.n_embd

    def max_positions(self) -> int:
        """``n_positions`` (learned position embeddings)."""
        return self.n_positions

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def decoder_shape(self) -> DecoderShape:
        """Multi-head attention and a plain two-matrix MLP of width ``inner_size``."""
        return DecoderShape(
            layers=self.n_layer,
            width=self.n_embd,
            heads=self.n_head,
            kv_heads=self.n_head,
            head_dim=self.n_embd // self.n_head,
            mlp_width=self.inner_size,
            mlp_matrices=2,
            vocab=self.vocab_size,
        )


FAMILY = Family(
    name="gpt2",
    config=GPT2Config,
    code="functrain.models.gpt2",
    kind="causal_lm",
    scans_layers=False,
    context_parallel=False,
    pipeline=False,
    generation_cache=True,
    hf_model_types=("gpt2",),
    hf_mapping="torch_bridge.hf.mappings:GPT2",
)
