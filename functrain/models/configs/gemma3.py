"""``model.name: gemma3_text``: Gemma 2's config with per-head query/key norms, one global layer in six and
a local RoPE base for the sliding layers (:mod:`functrain.models.gemma3`)."""

from typing import Any, ClassVar, Literal

import pydantic

from functrain.models.configs.gemma2 import Gemma2Config
from functrain.models.family import Family


class Gemma3TextConfig(Gemma2Config):
    """Gemma 3 text hyper-parameters, named as in HF's config.json (old layout: ``rope_local_base_freq``)."""

    name: Literal["gemma3_text"] = "gemma3_text"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(262208, gt=0)
    max_position_embeddings: int = pydantic.Field(131072, gt=0)
    rope_theta: float = 1000000.0
    rope_local_base_freq: float = 10000.0
    attn_logit_softcapping: float | None = pydantic.Field(None, gt=0)
    final_logit_softcapping: float | None = pydantic.Field(None, gt=0)

    sliding_window_pattern: ClassVar[int] = 6

    @property
    def qk_norm(self) -> bool:
        """Gemma 3 normalises each query and key head."""
        return True

    def rope_for(self, layer: int) -> Any:
        """Sliding layers use the plain local theta; global ones ``rope_theta`` and ``rope_scaling``."""
        if self.attention_window(layer) is None:
            return self
        return self.model_copy(update={"rope_theta": self.rope_local_base_freq, "rope_scaling": None})


FAMILY = Family(
    name="gemma3_text",
    config=Gemma3TextConfig,
    code="functrain.models.gemma3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("gemma3_text",),
    hf_mapping="torch_bridge.hf.mappings:GEMMA2",
)
