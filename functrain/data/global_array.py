"""Turn each process's slice of a batch into one global ``jax.Array`` sharded along the batch axis, and back.

Each process holds rows ``[p*B/P, (p+1)*B/P)``; ``jax.make_array_from_process_local_data`` places them on the
process's devices. That is right only when the mesh gives process ``p`` exactly those rows, which holds for
meshes whose device order is process-major (``jax.make_mesh``, ``mesh_utils.create_device_mesh``); anything
else is reported instead of silently mixing up samples.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from functrain.errors import DataError

# The mesh axes a batch is split over (the rest of the mesh holds replicas of each row); ``expert`` is data
# parallelism outside a mixture of experts' experts.
BATCH_AXES = ("data", "fsdp", "expert")


def batch_sharding(mesh: Mesh, batch_axis: int = 1, mesh_axes: Sequence[str] | None = None) -> NamedSharding:
    """The sharding that splits array axis ``batch_axis`` over ``mesh_axes`` (default: those of
    :data:`BATCH_AXES` in the mesh, or all mesh axes if it has none) and replicates the rest."""
    if mesh_axes is None:
        mesh_axes = tuple(name for name in BATCH_AXES if name in mesh.axis_names) or tuple(mesh.axis_names)
    return NamedSharding(mesh, PartitionSpec(*([None] * batch_axis), tuple(mesh_axes)))


@functools.lru_cache(maxsize=64)
def _check_process_rows(sharding: Sharding, global_shape: tuple[int, ...], batch_axis: int) -> None:
    """Raise unless this process's devices hold exactly its contiguous block of batch rows."""
    process, processes = jax.process_index(), jax.process_count()
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        if index is not None:  # None: the device holds no part of the array
            rows.update(range(global_shape[batch_axis])[index[batch_axis]])
    local = global_shape[batch_axis] // processes
    expected = set(range(process * local, (process + 1) * local))
    if rows != expected:
        held = f"rows {min(rows)}..{max(rows)} ({len(rows)} rows)" if rows else "no rows"
        raise DataError(
            f"the batch sharding gives process {process} batch {held} but its data slice is rows "
            f"{process * local}..{(process + 1) * local - 1}; shard the batch over a mesh with process-major "
            f"device order (jax.make_mesh) and split it across all processes"
        )


def to_global(host_batch: Any, sharding_or_mesh: Sharding | Mesh, batch_axis: int = 1) -> Any:
    """Assemble this process's ``host_batch`` (a pytree of numpy arrays) into global ``jax.Array`` s.

    Args:
      host_batch: this process's rows, e.g. a :class:`BatchLoader` call ``[K, B/P, ...]``.
      sharding_or_mesh: the sharding for every leaf, or a mesh (then :func:`batch_sharding` is used).
      batch_axis: the axis holding batch rows: 1 for stacked ``[K, B/P, ...]`` calls, 0 for one batch.

    The global batch axis is ``process_count`` times the local one; with one process this is a plain
    sharded ``device_put``.
    """
    if isinstance(sharding_or_mesh, Mesh):
        sharding: Sharding = batch_sharding(sharding_or_mesh, batch_axis)
    else:
        sharding = sharding_or_mesh
    processes = jax.process_count()
    if processes == 1:
        # The local rows are the global batch: one batched transfer for the whole tree (per-leaf calls cost
        # ~0.2 ms each, as much as a small model's whole step).
        return jax.device_put(host_batch, sharding)

    def place(local: Any) -> jax.Array:
        local = np.asarray(local)
        shape = list(local.shape)
        shape[batch_axis] *= processes
        global_shape = tuple(shape)
        _check_process_rows(sharding, global_shape, batch_axis)
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return jax.tree.map(place, host_batch)


def to_local(array: jax.Array, batch_axis: int = 0) -> np.ndarray:
    """This process's rows of a global array split along ``batch_axis`` only (:func:`to_global`'s inverse), as a
    host array: the whole array with one process."""
    if jax.process_count() == 1:
        return np.asarray(array)
    blocks: dict[int, Any] = {}
    for shard in array.addressable_shards:  # a block of rows once, whichever local devices hold replicas of it
        blocks.setdefault(shard.index[batch_axis].start or 0, shard.data)
    return np.concatenate([np.asarray(blocks[start]) for start in sorted(blocks)], axis=batch_axis)
