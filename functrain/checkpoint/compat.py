"""Check, before reading any array, that a saved tree fits the tree the run expects.

Paths are written ``"a/b/0/c"`` for both sides: dict keys, attribute names (flax / optax
dataclasses and namedtuples) and sequence indices, so a saved namedtuple (stored by orbax as a dict)
and the live one compare equal.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from functrain.core.tree import path_string

_MAX_LISTED = 8


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{path: (shape, dtype name)}`` for every leaf with a shape and dtype (arrays, metadata, structs)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_string(path): (tuple(leaf.shape), np.dtype(leaf.dtype).name)
            for path, leaf in leaves if hasattr(leaf, "shape") and hasattr(leaf, "dtype")}


def describe(shape: tuple[int, ...], dtype: str) -> str:
    """``float32[4,3]``."""
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def mismatches(item: str, saved: dict, expected: dict) -> list[str]:
    """Human-readable differences between saved and expected ``{path: (shape, dtype)}`` maps."""
    problems = []
    for path in sorted(expected.keys() & saved.keys()):
        if saved[path] != expected[path]:
            problems.append(f"{item}/{path}: checkpoint {describe(*saved[path])} vs "
                            f"model {describe(*expected[path])}")
    problems += [f"{item}/{path}: missing from checkpoint" for path in sorted(expected.keys() - saved.keys())]
    problems += [f"{item}/{path}: in checkpoint but not in model" for path in sorted(saved.keys() - expected.keys())]
    return problems


def summarize(problems: list[str]) -> str:
    """The first few problems on one line, with a count of the rest."""
    shown = "; ".join(problems[:_MAX_LISTED])
    rest = len(problems) - _MAX_LISTED
    return shown + (f"; and {rest} more" if rest > 0 else "")
