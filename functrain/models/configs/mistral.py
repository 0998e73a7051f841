"""``model.name: mistral``: Llama without biases, a sliding window on every layer (:mod:`functrain.models.mistral`)."""

from typing import Literal

import pydantic

from functrain.models.configs.llama import LlamaConfig
from functrain.models.family import Family


class MistralConfig(LlamaConfig):
    """Mistral hyper-parameters, named as in HF's config.json (``sliding_window`` None: full attention)."""

    name: Literal["mistral"] = "mistral"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    attention_bias: Literal[False] = False
    mlp_bias: Literal[False] = False
    sliding_window: int | None = pydantic.Field(None, gt=0)

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on every layer (HF's Mistral ignores ``layer_types``)."""
        return self.sliding_window


FAMILY = Family(
    name="mistral",
    config=MistralConfig,
    code="functrain.models.mistral",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("mistral",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
