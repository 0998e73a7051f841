"""``model.name: mlp``: the multi-layer perceptron classifier (:mod:`functrain.models.mlp`)."""

from typing import Literal

from pydantic import ConfigDict, Field

from functrain.models.configs.base import FamilyConfig
from functrain.models.family import Family


class MLPConfig(FamilyConfig):
    """``model.*`` keys of the MLP."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["mlp"] = "mlp"
    hidden: list[int] = Field(default_factory=lambda: [128, 128])
    num_classes: int = Field(10, ge=2)

    def class_count(self) -> int:
        """``num_classes``."""
        return self.num_classes


FAMILY = Family(
    name="mlp",
    config=MLPConfig,
    code="functrain.models.mlp",
    kind="classifier",
    scans_layers=False,
    context_parallel=False,
    pipeline=False,
    generation_cache=False,
    torch_twin="torch_bridge.twins:MLP_TWIN",
)
