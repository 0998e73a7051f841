"""``model.rope_scaling``: HF's rotary-embedding scaling settings (computed in :mod:`functrain.models.rope`)."""

import dataclasses
from typing import Literal

import pydantic

# Keys of each scaling type's HF ``rope_parameters`` that functrain.models.rope implements (besides rope_type/theta).
REQUIRED_KEYS = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"},
}
_OPTIONAL = {
    "yarn": {"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"},
    "longrope": {"factor", "attention_factor"},
}


class RopeScaling(pydantic.BaseModel):
    """HF ``rope_parameters``/``rope_scaling`` beyond the plain theta; unknown keys are errors naming them."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rope_type: Literal["linear", "dynamic", "yarn", "llama3", "longrope"]
    factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    @pydantic.model_validator(mode="after")
    def _keys_fit_the_type(self):
        given = {k for k, v in self.model_dump(exclude={"rope_type"}).items() if v is not None}
        required, optional = REQUIRED_KEYS[self.rope_type], _OPTIONAL.get(self.rope_type, set())
        if required - given:
            raise ValueError(f"rope type {self.rope_type!r} needs {', '.join(sorted(required - given))}")
        if given - required - optional:
            raise ValueError(
                f"rope type {self.rope_type!r} does not implement {', '.join(sorted(given - required - optional))}"
            )
        return self


@dataclasses.dataclass(frozen=True)
class RopeSettings:
    """One layer's rotary embedding where it is not the config's own (``rope_theta``, ``rope_scaling``,
    ``attn_head_dim``, ``max_position_embeddings``): what :func:`functrain.models.rope.frequencies` reads."""

    rope_theta: float
    rope_scaling: RopeScaling | None
    attn_head_dim: int  # the features that rotate: a head's, or its leading part (a partial rotary factor)
    max_position_embeddings: int
