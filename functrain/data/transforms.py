"""Per-record random transforms (augmentation) that replay exactly after a resume.

A transform is ``transform(record: dict, rng: np.random.Generator) -> dict``. The generator for a record is
a Philox stream keyed by ``(seed, stream index)``, the record's place in the sample stream (not its record
index, so each epoch augments a record differently). It depends on nothing else: not on the process, the batch
size, the prefetch depth or what ran before, so a resumed or re-sharded run sees the same augmentations.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from functrain.data.sources import Batch, stack_records

Transform = Callable[[dict[str, np.ndarray], np.random.Generator], dict[str, np.ndarray]]


def sample_rng(seed: int, stream_index: int) -> np.random.Generator:
    """The generator for the sample at ``stream_index`` of a run with data seed ``seed``."""
    key = np.array([int(stream_index), int(seed) % 2**64], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key))


def apply_transform(batch: Batch, transform: Transform, seed: int, stream_indices: np.ndarray) -> Batch:
    """Apply ``transform`` to every record of ``batch`` (row ``i`` is sample ``stream_indices[i]``)."""
    size = len(stream_indices)
    records = [
        transform({name: value[i] for name, value in batch.items()}, sample_rng(seed, stream_indices[i]))
        for i in range(size)
    ]
    return stack_records(records)
