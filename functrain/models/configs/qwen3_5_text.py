"""``model.name: qwen3_5_text``: Qwen3.5's language model (dense): Qwen3-Next's hybrid of Gated DeltaNet and gated
full attention with separate input projections and one MLP a layer (:mod:`functrain.models.qwen3_5`)."""

from typing import Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.qwen3_next import HybridConfig
from functrain.models.family import Family


class Qwen3_5TextConfig(HybridConfig):
    """Qwen3.5 (text) hyper-parameters, named as in HF's config.json."""

    name: Literal["qwen3_5_text"] = "qwen3_5_text"
    vocab_size: int = pydantic.Field(248320, gt=0)
    hidden_size: int = pydantic.Field(4096, gt=0)
    intermediate_size: int = pydantic.Field(12288, gt=0)
    num_hidden_layers: int = pydantic.Field(32, gt=0)
    num_key_value_heads: int = pydantic.Field(4, gt=0)

    def decoder_shape(self) -> DecoderShape:
        """The hybrid's shape with its MLP of ``intermediate_size``."""
        return self.hybrid_shape(self.intermediate_size)


FAMILY = Family(
    name="qwen3_5_text",
    config=Qwen3_5TextConfig,
    code="functrain.models.qwen3_5",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,
    pipeline=False,
    generation_cache=True,
    hf_model_types=("qwen3_5_text",),
    hf_mapping="torch_bridge.hf.hybrid_mappings:QWEN3_NEXT",
)
