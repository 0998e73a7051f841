"""Model registry: ``model.name`` in a config -> its family's declaration (:class:`~functrain.models.family.Family`).

The families register where they live: each module of :mod:`functrain.models.configs` that declares a ``FAMILY``
is one (its config class is pydantic only, so the run config's ``model`` section validates without model code),
and a third-party package adds its own through an entry point of the group ``functrain.families`` whose object is
its ``Family``. The registry is read on first use, so importing a model module loads no family and no plugin; the
code of a family is imported when a model of it is built, so a config naming one model never imports the others.
Every list of families (the config's union, one-line errors, the docs' tables) comes from :func:`family_names`.
"""

import functools
import importlib
import importlib.metadata
import pkgutil
import types
from collections.abc import Iterable, Mapping
from typing import Any

from functrain.errors import ConfigError
from functrain.models import configs
from functrain.models.configs.base import FamilyConfig, ModelConfig
from functrain.models.family import Family

ENTRY_POINT_GROUP = "functrain.families"


def declared_families() -> list[tuple[str, Family]]:
    """``(module, family)`` for each module of :mod:`functrain.models.configs` that declares a ``FAMILY``."""
    found = []
    for info in pkgutil.iter_modules(configs.__path__, f"{configs.__name__}."):
        family = getattr(importlib.import_module(info.name), "FAMILY", None)
        if family is not None and not isinstance(family, Family):
            raise TypeError(f"{info.name}.FAMILY is a {type(family).__name__}, not a Family; declare Family(...)")
        if family is not None:
            found.append((info.name, family))
    return found


def plugin_family(entry_point: importlib.metadata.EntryPoint) -> tuple[str, Family]:
    """``(where, family)`` of an entry point of the ``functrain.families`` group; a plugin that fails to load, or
    whose object is not a Family, is a one-line ConfigError naming it."""
    where = f"family plugin {entry_point.name!r} ({entry_point.value})"
    try:
        family = entry_point.load()
    except Exception as exc:  # noqa: BLE001 -- whatever third-party code raises is reported in the plugin's line
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"{where} does not load ({type(exc).__name__}: {reason}); fix or uninstall the package that provides it"
        ) from None
    if not isinstance(family, Family):
        raise ConfigError(
            f"{where} is a {type(family).__name__}, not a functrain Family; point the entry point at one "
            f"(package.module:FAMILY)"
        )
    return where, family


def collect_families(
    declared: Iterable[tuple[str, Family]], entry_points: Iterable[importlib.metadata.EntryPoint] = ()
) -> Mapping[str, Family]:
    """The registry: the ``declared`` families and the plugins' by name, sorted; two of one name, or two claiming
    one HF ``model_type``, are a one-line ConfigError naming both."""
    by_name: dict[str, tuple[str, Family]] = {}
    by_model_type: dict[str, str] = {}
    for where, family in [*declared, *map(plugin_family, entry_points)]:
        if family.name in by_name:
            raise ConfigError(
                f"{where} declares family {family.name!r}, as {by_name[family.name][0]} does; rename one of them"
            )
        by_name[family.name] = (where, family)
        for model_type in family.hf_model_types:
            if model_type in by_model_type:
                raise ConfigError(
                    f"{where} converts HF model_type {model_type!r}, as family {by_model_type[model_type]!r} does; "
                    f"keep one of them"
                )
            by_model_type[model_type] = family.name
    return types.MappingProxyType({name: by_name[name][1] for name in sorted(by_name)})


@functools.cache
def families() -> Mapping[str, Family]:
    """Every registered family by name (sorted): functrain's own and the installed plugins'."""
    return collect_families(declared_families(), importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def family_names(capability: str | None = None) -> list[str]:
    """The registered families' names (sorted); with ``capability`` (one of
    :data:`functrain.models.family.CAPABILITIES`), those that have it."""
    return [name for name, family in families().items() if capability is None or family.can(capability)]


def family_named(name: str) -> Family:
    """The family registered as ``name``; an unknown name is a ValueError listing the known ones."""
    if name not in families():
        raise ValueError(f"unknown model.name {name!r}; choose one of {', '.join(families())}")
    return families()[name]


def family_of(model_config: ModelConfig) -> Family | None:
    """The family of a model section; None for a user model (``model.target``, a model given to ``fit``)."""
    name = model_config.registry_name()
    return None if name is None else family_named(name)


def model_config_class(name: str) -> type[FamilyConfig]:
    """The pydantic schema of model ``name``'s config section (no model code imported)."""
    return family_named(name).config


def build_model(model_config: FamilyConfig, dtype: Any = None) -> Any:
    """The Flax module for a validated model config, computing in ``dtype`` (float32 when None)."""
    build = family_named(model_config.name).module().build
    return build(model_config) if dtype is None else build(model_config, dtype=dtype)


def is_language_model(name: str) -> bool:
    """Whether registered model ``name`` is a causal language model (what decoding and scoring callbacks need)."""
    return family_named(name).language_model
