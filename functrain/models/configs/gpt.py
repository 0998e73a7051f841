"""``model.name: gpt``: the small GPT (:mod:`functrain.models.gpt`)."""

from typing import Hashable, Literal

from pydantic import ConfigDict, Field, model_validator

from functrain.models.configs.base import DecoderShape
from functrain.models.family import Family
from functrain.models.options import RuntimeOptions


class GPTConfig(RuntimeOptions):
    """``model.*`` keys of the GPT."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["gpt"] = "gpt"
    vocab_size: int = Field(256, ge=2)  # byte-level text
    max_len: int = Field(256, ge=1)
    d_model: int = Field(128, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(512, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "GPTConfig":
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                f"choose n_heads so that d_model / n_heads is a whole head width"
            )
        return self

    def max_positions(self) -> int:
        """``max_len`` (learned position embeddings)."""
        return self.max_len

    def vocabulary_size(self) -> int:
        """``vocab_size``."""
        return self.vocab_size

    def decoder_shape(self) -> DecoderShape:
        """Multi-head attention and a plain two-matrix MLP of width ``d_ff``."""
        return DecoderShape(
            layers=self.n_layers,
            width=self.d_model,
            heads=self.n_heads,
            kv_heads=self.n_heads,
            head_dim=self.d_model // self.n_heads,
            mlp_width=self.d_ff,
            mlp_matrices=2,
            vocab=self.vocab_size,
        )

    def layer_kinds(self) -> list[Hashable]:
        """Every block is alike."""
        return [None] * self.n_layers


FAMILY = Family(
    name="gpt",
    config=GPTConfig,
    code="functrain.models.gpt",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    torch_twin="torch_bridge.twins:GPT_TWIN",
)
