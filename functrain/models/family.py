"""A model family's declaration, made where the family lives.

Each family's light config module (``functrain/models/configs/<family>.py``, pydantic only, no JAX) ends with
``FAMILY = Family(...)``: its ``model.name``, config class, the module of its code (imported on first use), the HF
``model_type``\\ s it converts and where their tensor mapping lives, and what it can do. A third-party package
declares one the same way and points an entry point of the group ``functrain.families`` at it
(:mod:`functrain.models` collects both). Every list of families functrain shows (the config's union, one-line
errors, the docs' tables) is read off these records.

The mapping and the torch twin live in ``torch_bridge``, a floor above the models: a family names them by import
path (``"package.module:NAME"``), and the bridge imports them when it converts or trains that family.
"""

import dataclasses
import importlib
from types import ModuleType
from typing import Any, Literal

from functrain.models.configs.base import FamilyConfig
from functrain.models.configs.moe import MoeOptions

Kind = Literal["classifier", "causal_lm"]
KINDS: tuple[Kind, ...] = ("classifier", "causal_lm")

# What a family can do, by the names family_names() and the docs' family lists select on.
CAPABILITIES = (
    "language_model",
    "scans_layers",
    "context_parallel",
    "pipeline",
    "expert_parallel",
    "generation_cache",
    "hf_conversion",
    "torch_twin",
    "batch_invariant",
)


class _Undeclared:
    def __repr__(self) -> str:
        return "<undeclared>"


# The default of a field every family must declare. A dataclass field without a default would be refused too, but
# by a TypeError that names neither the family nor the other missing fields; this lets one line name them all.
_UNDECLARED: Any = _Undeclared()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: what ``model.name`` selects, and what the rest of functrain may ask of it.

    Required: ``name``; ``config``, the pydantic class of its ``model`` section (its ``name`` field defaults to
    ``name``); ``code``, the module whose ``build(config, dtype=...)`` makes the Flax module (with HF conversion
    also ``from_hf_config(dict)`` and ``to_hf_config(config)``); ``kind``; and its capabilities: ``scans_layers``
    (``model.scan_layers`` runs its layers as one scan), ``context_parallel`` (its attention splits the sequence
    over ``mesh.context``), ``pipeline`` (``mesh.pipeline`` splits its scanned layers into stages) and
    ``generation_cache`` (it decodes with :mod:`functrain.models.kv_cache`: ``generate``, ``eval``,
    ``eval.samples``).

    Optional: ``batch_invariant`` (``model.batch_invariant`` makes its forward batch-invariant,
    :mod:`functrain.models.batch_invariant`: every product and attention of its forward goes through the built-in
    dense products and :func:`~functrain.models.attention.attend`); ``hf_model_types`` with ``hf_mapping``
    (``"package.module:NAME"`` of the ``torch_bridge.hf.mappings.TensorMapping`` that converts them; the first
    type is the one exports write), and
    ``torch_twin`` (``"package.module:NAME"`` of a ``torch_bridge.twins.TorchTwin``, for ``backend: torch``).
    Expert parallelism is read from the config class: a config with the mixture-of-experts options
    (:class:`~functrain.models.configs.moe.MoeOptions`) has the experts ``mesh.expert`` splits.
    """

    name: str = _UNDECLARED
    config: type[FamilyConfig] = _UNDECLARED
    code: str = _UNDECLARED
    kind: Kind = _UNDECLARED
    scans_layers: bool = _UNDECLARED
    context_parallel: bool = _UNDECLARED
    pipeline: bool = _UNDECLARED
    generation_cache: bool = _UNDECLARED
    batch_invariant: bool = False
    hf_model_types: tuple[str, ...] = ()
    hf_mapping: str | None = None
    torch_twin: str | None = None

    def __post_init__(self) -> None:
        problem = _missing(self) or _problem(self)
        if problem:
            raise ValueError(problem)

    @property
    def language_model(self) -> bool:
        """Whether it is a causal language model (what decoding, scoring and teachers need)."""
        return self.kind == "causal_lm"

    @property
    def expert_parallel(self) -> bool:
        """Whether it is a mixture of experts whose experts ``mesh.expert`` splits (its config has MoeOptions)."""
        return issubclass(self.config, MoeOptions)

    @property
    def hf_conversion(self) -> bool:
        """Whether HF checkpoints convert into it and back (it declares ``hf_model_types``)."""
        return bool(self.hf_model_types)

    def can(self, capability: str) -> bool:
        """Whether the family has ``capability`` (one of :data:`CAPABILITIES`)."""
        if capability not in CAPABILITIES:
            raise ValueError(f"unknown family capability {capability!r}; choose one of {', '.join(CAPABILITIES)}")
        return bool(getattr(self, capability))

    def module(self) -> ModuleType:
        """The module of its code (imported now, on first use)."""
        return importlib.import_module(self.code)


def _missing(family: Family) -> str | None:
    missing = [field.name for field in dataclasses.fields(family) if getattr(family, field.name) is _UNDECLARED]
    if not missing:
        return None
    them = "it" if len(missing) == 1 else "them"
    return f"{_label(family)} declares no {', '.join(missing)}; add {them} to its Family(...)"


def _label(family: Family) -> str:
    if isinstance(family.name, str) and family.name is not _UNDECLARED:
        return f"family {family.name!r}"
    config = family.config
    return f"the family of {config.__name__}" if isinstance(config, type) else "a family"


def _problem(family: Family) -> str | None:
    """The first thing wrong with a declaration whose fields are all given, as one line; None when it is sound."""
    label = _label(family)
    if not (isinstance(family.name, str) and family.name.isidentifier()):
        return f"family name {family.name!r} is not an identifier; name it like a Python variable (my_family)"
    if not (isinstance(family.config, type) and issubclass(family.config, FamilyConfig)):
        return f"{label}: config {family.config!r} is not a FamilyConfig subclass; derive the config class from it"
    tag = family.config.model_fields["name"].default
    if tag != family.name:
        return (
            f"{label}: its config {family.config.__name__} has name {tag!r}; declare "
            f"name: Literal[{family.name!r}] = {family.name!r} in it"
        )
    if family.kind not in KINDS:
        return f"{label} declares kind {family.kind!r}; choose one of {', '.join(KINDS)}"
    flags = ("scans_layers", "context_parallel", "pipeline", "generation_cache", "batch_invariant")
    not_bool = [flag for flag in flags if not isinstance(getattr(family, flag), bool)]
    if not_bool:
        return f"{label} declares {', '.join(not_bool)} as something else than True or False; declare a bool"
    if family.pipeline and not family.scans_layers:
        return f"{label} declares pipeline without scans_layers; pipeline stages split scanned layers"
    if family.generation_cache and not family.language_model:
        return f"{label} declares generation_cache but is a {family.kind}; only a causal_lm decodes"
    types = family.hf_model_types
    if not (isinstance(types, tuple) and all(isinstance(model_type, str) and model_type for model_type in types)):
        return f"{label} declares hf_model_types={types!r}; declare a tuple of HF model_type strings"
    if bool(types) != (family.hf_mapping is not None):
        return (
            f"{label} declares {'hf_model_types' if types else 'hf_mapping'} without "
            f"{'hf_mapping' if types else 'hf_model_types'}; declare both or neither"
        )
    paths = {"code": family.code, "hf_mapping": family.hf_mapping, "torch_twin": family.torch_twin}
    for field, path in paths.items():
        if path is not None and not _import_path(path, attribute=field != "code"):
            form = "package.module:NAME" if field != "code" else "package.module"
            return f"{label} declares {field}={path!r}; write it as {form!r}"
    return None


def _import_path(path: Any, attribute: bool) -> bool:
    """Whether ``path`` reads ``package.module:NAME`` (``attribute``) or ``package.module``."""
    if not isinstance(path, str):
        return False
    module, colon, name = path.partition(":")
    parts = module.split(".") + ([name] if attribute else [])
    return bool(colon) == attribute and all(part.isidentifier() for part in parts)
