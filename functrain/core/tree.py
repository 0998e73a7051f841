"""Tree helpers shared by sharding rules, checkpoints, trackers and the torch bridge."""

from typing import Any, Mapping

import jax


def path_string(path: tuple) -> str:
    """``block_0/mlp_in/kernel`` for a pytree key path (dict keys, attribute names and indices alike)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def flatten_dotted(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": leaf}`` (torch's dotted parameter names, trackers' metric keys)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
