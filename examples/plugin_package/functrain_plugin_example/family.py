"""``model.name: tiny_mlp``: the family's config section and its declaration.

Like functrain's own families, this module is light (pydantic only): functrain imports it to validate configs,
and imports the model code (``functrain_plugin_example.model``) only when it builds a model of this family.
"""

from typing import Literal

from pydantic import ConfigDict, Field

from functrain.models.configs.base import FamilyConfig
from functrain.models.family import Family


class TinyMLPConfig(FamilyConfig):
    """``model.*`` keys of the tiny MLP: one hidden layer of ``width``, ``num_classes`` outputs."""

    model_config = ConfigDict(extra="forbid")
    name: Literal["tiny_mlp"] = "tiny_mlp"
    width: int = Field(32, ge=1)
    num_classes: int = Field(10, ge=2)

    def class_count(self) -> int:
        """``num_classes`` (functrain checks the labels against it)."""
        return self.num_classes


FAMILY = Family(
    name="tiny_mlp",
    config=TinyMLPConfig,
    code="functrain_plugin_example.model",
    kind="classifier",
    scans_layers=False,
    context_parallel=False,
    pipeline=False,
    generation_cache=False,
)
