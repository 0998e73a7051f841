"""Check, before reading any array, that a saved tree fits the tree the run expects.

Paths are written ``"a/b/0/c"`` for both sides: dict keys, attribute names (flax / optax
dataclasses and namedtuples) and sequence indices, so a saved namedtuple (stored by orbax as a dict)
and the live one compare equal. Layers saved scanned (stacked) and expected unrolled, or the other way
(``model.scan_layers`` changed between runs), compare in the expected layout: the restore converts them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from functrain.core.tree import path_string
from functrain.models.stacking import relayout_flat

_MAX_LISTED = 8


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype name)}`` for every leaf with a shape and dtype (arrays, metadata, structs)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        path_string(path): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
        for path, leaf in leaves
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype")
    }


def in_layout_of(
    saved: dict[str, tuple[tuple[int, ...], str]], expected: dict[str, tuple[tuple[int, ...], str]]
) -> dict[str, tuple[tuple[int, ...], str]]:
    """``saved`` (``{path: (shape, dtype)}``) with its layers stacked or unrolled as in ``expected``."""

    def structs(flat: dict) -> dict[str, jax.ShapeDtypeStruct]:
        return {path: jax.ShapeDtypeStruct(shape, dtype) for path, (shape, dtype) in flat.items()}

    relaid = relayout_flat(structs(saved), structs(expected))
    return {path: (tuple(leaf.shape), np.dtype(leaf.dtype).name) for path, leaf in relaid.items()}


def describe(shape: tuple[int, ...], dtype: str) -> str:
    """``float32[4,3]``."""
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def mismatches(item: str, saved: dict, expected: dict) -> list[str]:
    """Human-readable differences between saved and expected ``{path: (shape, dtype)}`` maps."""
    problems = []
    for path in sorted(expected.keys() & saved.keys()):
        if saved[path] != expected[path]:
            problems.append(f"{item}/{path}: checkpoint {describe(*saved[path])} vs model {describe(*expected[path])}")
    problems += [f"{item}/{path}: missing from checkpoint" for path in sorted(expected.keys() - saved.keys())]
    problems += [f"{item}/{path}: in checkpoint but not in model" for path in sorted(saved.keys() - expected.keys())]
    return problems


def summarize(problems: list[str]) -> str:
    """The first few problems on one line, with a count of the rest."""
    shown = "; ".join(problems[:_MAX_LISTED])
    rest = len(problems) - _MAX_LISTED
    return shown + (f"; and {rest} more" if rest > 0 else "")
