"""The ``model.lora`` section (low-rank adapters, :mod:`functrain.models.lora`)."""

import pydantic


class LoraConfig(pydantic.BaseModel):
    """The ``model.lora`` section."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rank: int = pydantic.Field(8, gt=0)
    alpha: float = pydantic.Field(16.0, gt=0)
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)
    targets: tuple[str, ...] = pydantic.Field(("q_proj", "v_proj"), min_length=1)

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank
