"""The JSON ``meta`` item stored with every checkpoint: format version, metrics, versions.

The loop fills in the run facts (epoch, samples_consumed, config digest, ...); this module only owns
what every checkpoint needs to be read back safely: ``format_version``, ``step``, ``time`` and the
``best_metric`` record used for retention and ``functrain inspect``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import time
from typing import Any, Mapping

import numpy as np

from functrain.errors import CheckpointError

#: Version of the checkpoint layout written by this functrain. Bump when a reader of the old
#: layout would misread the new one; readers refuse anything newer than this.
FORMAT_VERSION = 1

#: Meta keys of a LoRA step whose "params" item holds the adapters only: the step holding the frozen base
#: weights (its "base step") and that step's fingerprint (``reader.base_fingerprint``), which catches a base
#: step replaced by another save of the same number.
LORA_BASE_STEP, LORA_BASE_FINGERPRINT = "lora_base_step", "lora_base_fingerprint"

_VERSIONED_PACKAGES = ("functrain", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "torch")


@functools.cache
def package_versions(packages: tuple[str, ...] = _VERSIONED_PACKAGES) -> dict[str, str]:
    """Installed versions of the packages that shape a checkpoint (absent ones are left out)."""
    versions: dict[str, str] = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def jsonable(value: Any) -> Any:
    """``value`` with numpy / jax scalars and arrays turned into plain JSON types.

    Non-finite floats become ``None`` so the file stays strict JSON that any reader accepts.
    """
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if hasattr(value, "__array__"):  # numpy / jax scalars and arrays
        array = np.asarray(value)
        return jsonable(array.item() if array.ndim == 0 else array.tolist())
    return str(value)


def metric_value(meta: Mapping[str, Any], name: str) -> float | None:
    """The value of metric ``name`` ("split/metric", e.g. "eval/loss") recorded in ``meta``.

    Accepts ``meta["metrics"]`` nested by split (``{"eval": {"loss": 0.3}}``) or flat
    (``{"eval/loss": 0.3}``). Missing or non-finite values give ``None``.
    """
    metrics = meta.get("metrics") or {}
    value = metrics.get(name)
    if value is None and "/" in name:
        split, metric = name.split("/", 1)
        nested = metrics.get(split)
        value = nested.get(metric) if isinstance(nested, Mapping) else None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def complete_meta(
    meta: Mapping[str, Any] | None,
    step: int,
    best: Mapping[str, Any] | None,
    items: list[str],
    checksums: Mapping[str, Any] | None,
) -> dict:
    """``meta`` plus the fields every checkpoint carries: format version, step, time, versions, best
    metric, the items saved and how their checksums were recorded."""
    full = dict(meta or {})
    full["format_version"] = FORMAT_VERSION
    full["step"] = int(step)
    full["items"] = list(items)
    if checksums is not None:
        full["checksums"] = dict(checksums)
    full.setdefault("time", time.time())
    full.setdefault("versions", dict(package_versions()))
    if best is not None:
        full["best_metric"] = dict(best, value=metric_value(full, best["name"]))
    return jsonable(full)


def saved_items(meta: Mapping[str, Any]) -> list[str]:
    """The items a step was saved with; a step lacking one of them is damaged.

    Steps from before ``items`` was recorded hold params and state, except converted models (params only:
    their optimizer starts fresh), which record ``converted_from``.
    """
    if isinstance(meta.get("items"), list):
        return [str(item) for item in meta["items"]]
    return ["params"] if meta.get("converted_from") else ["params", "state"]


def check_format_version(meta: Mapping[str, Any], where: str) -> None:
    """Raise ``CheckpointError`` if ``meta`` was written by a newer checkpoint format than ours."""
    version = meta.get("format_version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {where} has format_version {version!r} but this functrain reads up to "
            f"{FORMAT_VERSION}; upgrade functrain (pip install -U functrain) to read it"
        )
