"""The HF architectures functrain converts, read off the families' declarations: each registered family's
``hf_model_types`` with the :class:`~torch_bridge.hf.mappings.TensorMapping` its ``hf_mapping`` names and the
module of its code (``from_hf_config``, ``to_hf_config``, ``build``)."""

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from functrain.core.targets import import_target
from functrain.errors import CheckpointError, ConfigError
from functrain.models import families, family_names
from functrain.models.family import Family
from torch_bridge.hf.mappings import TensorMapping


@dataclass(frozen=True)
class Architecture:
    """Everything needed to convert one HF ``model_type``."""

    model_type: str
    family: str  # the functrain family (model.name) it converts into
    model: ModuleType  # the family's code: from_hf_config, to_hf_config, build
    mapping: TensorMapping


def _mapping_of(family: Family) -> TensorMapping:
    mapping = import_target(str(family.hf_mapping), f"family {family.name!r}'s hf_mapping")
    if not isinstance(mapping, TensorMapping):
        raise ConfigError(
            f"family {family.name!r}'s hf_mapping {family.hf_mapping!r} is a {type(mapping).__name__}, not a "
            f"torch_bridge.hf.mappings.TensorMapping; point it at one"
        )
    return mapping


@functools.cache
def architectures() -> Mapping[str, Architecture]:
    """HF ``model_type`` -> its :class:`Architecture`, for every registered family that converts one."""
    table = {}
    for family in families().values():
        if family.hf_conversion:
            mapping, module = _mapping_of(family), family.module()
            for model_type in family.hf_model_types:
                table[model_type] = Architecture(model_type, family.name, module, mapping)
    return dict(sorted(table.items()))


def _nearest_name(name: str, names: list[str]) -> str | None:
    """The name of ``names`` nearest ``name``: the longest shared prefix of three characters or more (a family's
    other versions: ``olmo2`` -> ``olmo3``, ``llama4_text`` -> ``llama``), then the closest spelling; None when
    none is near (``bert``)."""

    def prefix(other: str) -> int:
        return next((i for i, (a, b) in enumerate(zip(name, other)) if a != b), min(len(name), len(other)))

    def spelling(other: str) -> float:
        return difflib.SequenceMatcher(None, name, other).ratio()

    near = [other for other in names if prefix(other) >= 3 or spelling(other) >= 0.75]
    return max(near, key=lambda other: (prefix(other), spelling(other)), default=None)


def architecture_for(hf_config: dict[str, Any]) -> Architecture:
    """The architecture of an HF config.json; an unsupported ``model_type`` is a CheckpointError naming the nearest
    supported one (when one is near) and listing them all."""
    model_type = hf_config.get("model_type")
    arch = architectures().get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        near = _nearest_name(str(model_type), list(architectures()))
        nearest = f" (nearest supported: {near!r})" if near else ""
        raise CheckpointError(
            f"model_type {model_type!r} is not supported{nearest}; supported model types: {', '.join(architectures())}"
        )
    return arch


def exported_architecture(name: str | None, refusal: str) -> Architecture:
    """The architecture family ``name`` exports to (its first ``hf_model_types``); for a family without one, a
    CheckpointError: ``refusal`` and the families that export."""
    if name is None or name not in families() or not families()[name].hf_conversion:
        raise CheckpointError(f"{refusal}; supported: {', '.join(family_names('hf_conversion'))}")
    return architectures()[families()[name].hf_model_types[0]]
