"""``model.name: mixtral``: Mistral's attention with a mixture of experts in every layer
(:mod:`functrain.models.mixtral`)."""

from typing import Literal

import pydantic

from functrain.models.configs.mistral import MistralConfig
from functrain.models.configs.moe import LocalExperts
from functrain.models.family import Family


class MixtralConfig(LocalExperts, MistralConfig):
    """Mixtral hyper-parameters, named as in HF's config.json (``intermediate_size`` is each expert's width),
    plus the MoE options of :class:`LocalExperts`."""

    name: Literal["mixtral"] = "mixtral"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    num_key_value_heads: int | None = 8
    max_position_embeddings: int = pydantic.Field(4096 * 32, gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1000000.0
    router_jitter_noise: float = 0.0  # transformers' training-time input noise: only 0 (not implemented)

    @pydantic.field_validator("router_jitter_noise")
    @classmethod
    def _no_jitter(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"router_jitter_noise {value} is not implemented; set it to 0")
        return value


FAMILY = Family(
    name="mixtral",
    config=MixtralConfig,
    code="functrain.models.mixtral",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("mixtral",),
    hf_mapping="torch_bridge.hf.mappings:MIXTRAL",
)
