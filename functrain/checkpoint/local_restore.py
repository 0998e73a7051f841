"""Which step a restart restores when there are local checkpoints, and the shards a process gets from a peer.

Every process reports the local steps it holds whole (one all-gather of a few integers). Which shards each
process needs follows from the restore targets' shardings, so every process knows, without asking, which others
need exactly the same shards (data-parallel replicas). The newest step that every process can have — from its
own copy, or from a replica that holds it — is restored when it is at least as new as the newest persistent
step; otherwise the persistent step is (``None`` here). A process whose copy is gone (a replaced VM, a wiped
``/dev/shm``) receives the step's shards and meta from a replica by broadcast over the job's collectives, as raw
bytes, so the restored state is bitwise the saved one.

Orbax's emergency checkpoint manager (``orbax.checkpoint.experimental.emergency``, 0.12) was not used: it is
marked experimental, needs at least two data-parallel replicas along a replica axis of the mesh (slices), saves
the persistent tier from one replica only and, in its multi-tier form, a replicator service on GKE.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from functrain.checkpoint.local import Index, LocalCheckpoints, LocalStep, normalized
from functrain.parallel.distributed import all_rows

# Local steps a process reports (checkpoint.local_keep is at most 2).
_REPORTED = 2


def needed_shards(targets: list[Any], process: int) -> tuple[tuple[int, Index], ...]:
    """The distinct shards ``(leaf number, index)`` that ``process``'s devices hold of ``targets``."""
    needed = set()
    for number, target in enumerate(targets):
        for device, index in target.sharding.devices_indices_map(target.shape).items():
            if device.process_index == process:
                needed.add((number, normalized(index, target.shape)))
    return tuple(sorted(needed))


def _fits(local: LocalStep, targets: list[Any], needed: tuple[tuple[int, Index], ...]) -> bool:
    """Whether a local step holds exactly the shards this process needs, of the arrays the run has now."""
    leaves = [(tuple(leaf["shape"]), leaf["dtype"]) for leaf in local.manifest["leaves"]]
    saved = sorted((entry["leaf"], tuple(tuple(pair) for pair in entry["index"])) for entry in local.manifest["shards"])
    return leaves == [(tuple(t.shape), str(t.dtype)) for t in targets] and tuple(saved) == needed


def _choose(table: np.ndarray, needs: list[tuple]) -> tuple[int, dict[int, int]] | None:
    """The newest step every process can have, not older than the persistent one, and the process each gets it
    from; ``table`` rows: (newest persistent step or -1, local steps held or -1)."""
    persistent = int(table[0, 0])
    held = [set(int(step) for step in row[1:] if step >= 0) for row in table]
    for step in sorted(set().union(*held), reverse=True):
        if step < persistent:
            return None
        sources = {}
        for process, need in enumerate(needs):
            holders = [peer for peer in range(len(needs)) if step in held[peer] and needs[peer] == need]
            if not holders:
                break
            sources[process] = process if process in holders else holders[0]
        else:
            return step, sources
    return None


def _from_peer(
    shards: dict | None, meta: dict | None, needed: tuple, targets: list[Any], is_source: bool
) -> tuple[dict, dict]:
    """Broadcast the ``needed`` shards and the meta from the process that holds them (``is_source``)."""
    meta_bytes = json.dumps(meta).encode() if is_source else b""
    length = int(multihost_utils.broadcast_one_to_all(np.array([len(meta_bytes)], np.int32), is_source)[0])
    sizes = [
        int(np.prod([b - a for a, b in index])) * np.dtype(targets[number].dtype).itemsize for number, index in needed
    ]
    buffer = np.zeros(sum(sizes) + length, np.uint8)
    if is_source:
        assert shards is not None
        parts = [np.ascontiguousarray(shards[key]).view(np.uint8).reshape(-1) for key in needed]
        buffer[:] = np.concatenate([*parts, np.frombuffer(meta_bytes, np.uint8)])
    # Bytes, not values: a sum with zeros would turn -0.0 into 0.0.
    received = np.asarray(multihost_utils.broadcast_one_to_all(buffer, is_source)).astype(np.uint8)
    got, offset = {}, 0
    for (number, index), size in zip(needed, sizes):
        shape = [b - a for a, b in index]
        got[(number, index)] = received[offset : offset + size].view(np.dtype(targets[number].dtype)).reshape(shape)
        offset += size
    return got, json.loads(received[offset:].tobytes())


def restore_local(
    local: LocalCheckpoints, targets: dict[str, Any], newest_persistent: int | None
) -> tuple[dict, dict, int, str] | None:
    """``(items, meta, step, source)`` from the local checkpoints of all processes, or None when the newest
    persistent step is newer (or no step is whole everywhere). Every process calls it (collectives)."""
    leaves, treedef = jax.tree.flatten(targets)
    count, me = jax.process_count(), jax.process_index()
    needs = [needed_shards(leaves, process) for process in range(count)]
    fitting = [local_step for local_step in local.steps() if _fits(local_step, leaves, needs[me])]
    mine = {local_step.step: local_step for local_step in fitting[:_REPORTED] if local_step.verified()}
    held = sorted(mine, reverse=True)
    report = np.array([-1 if newest_persistent is None else newest_persistent, *held], np.int32)
    report = np.pad(report, (0, 1 + _REPORTED - len(report)), constant_values=-1)
    table = all_rows(report[None])  # [processes, report]
    chosen = _choose(table, needs)
    if chosen is None:
        return None
    step, sources = chosen
    shards = mine[step].read() if sources[me] == me else None
    meta = mine[step].manifest["meta"] if sources[me] == me else None
    for process in sorted(p for p, source in sources.items() if source != p):
        sent = sources[process]
        received = _from_peer(shards if me == sent else None, meta, needs[process], leaves, me == sent)
        if me == process:
            shards, meta = received
    assert shards is not None and meta is not None
    restored: dict = shards

    def array(number: int, target: Any) -> jax.Array:
        def shard(index: Any) -> np.ndarray:
            return restored[(number, normalized(index, target.shape))]

        return jax.make_array_from_callback(target.shape, target.sharding, shard)

    arrays = [array(number, target) for number, target in enumerate(leaves)]
    peers = [f"process {p} from process {source}" for p, source in sorted(sources.items()) if source != p]
    return jax.tree.unflatten(treedef, arrays), meta, step, f"peer: {', '.join(peers)}" if peers else "local"
