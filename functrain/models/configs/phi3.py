"""``model.name: phi3``: Mistral's config with ``longrope`` RoPE scaling (:mod:`functrain.models.phi3`)."""

from typing import Literal

import pydantic

from functrain.models.configs.mistral import MistralConfig
from functrain.models.family import Family


class Phi3Config(MistralConfig):
    """Phi-3 hyper-parameters, named as in HF's config.json (Mistral's: no biases, a window on every layer)."""

    name: Literal["phi3"] = "phi3"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    original_max_position_embeddings: int = pydantic.Field(4096, gt=0)

    @pydantic.model_validator(mode="after")
    def _longrope_fits_heads(self):
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            for name, factors in (("short_factor", scaling.short_factor), ("long_factor", scaling.long_factor)):
                if len(factors or ()) != self.attn_head_dim // 2:
                    raise ValueError(
                        f"rope {name} has {len(factors or ())} entries; head_dim "
                        f"{self.attn_head_dim} needs {self.attn_head_dim // 2}"
                    )
        return self


FAMILY = Family(
    name="phi3",
    config=Phi3Config,
    code="functrain.models.phi3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("phi3",),
    hf_mapping="torch_bridge.hf.mappings:PHI3",
)
