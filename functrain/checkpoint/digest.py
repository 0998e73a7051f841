"""A SHA-256 of parameter values that is the same for any mesh, process count or backend."""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np

from functrain.core.tree import path_string


def params_digest(params: Any) -> str:
    """Hex SHA-256 over every leaf of ``params`` in sorted path order.

    Each leaf contributes its path ("a/b/kernel"), dtype name, shape and C-order bytes, so renaming,
    reshaping or casting a parameter changes the digest. Leaves must be host-readable (numpy
    arrays, or jax arrays whose shards this process holds — e.g. the result of ``load_params``).
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    by_path = sorted(((path_string(path), np.asarray(leaf)) for path, leaf in leaves), key=lambda pa: pa[0])
    digest = hashlib.sha256()
    for path, array in by_path:
        header = f"{path}\0{array.dtype.name}\0{','.join(str(d) for d in array.shape)}\0"
        digest.update(header.encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()
