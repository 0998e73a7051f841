"""Pytree helpers shared by sharding rules and checkpoints."""

import jax


def path_string(path: tuple) -> str:
    """``block_0/mlp_in/kernel`` for a pytree key path (dict keys, attribute names and indices alike)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")
