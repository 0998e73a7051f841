"""Which record goes where: the data order as a pure function of ``(seed, position)``.

The sample stream is infinite: stream index ``g`` belongs to epoch ``g // N`` and is record
``perm_epoch(g % N)``, where ``perm_epoch`` is a permutation of ``[0, N)`` keyed by ``(seed, epoch)``.
The permutation is grain's index shuffle (a keyed cipher over ``[0, N)``): O(1) memory and O(1) work per
lookup, so any position can be served without materialising or replaying anything. A lookup costs ~25 us
from Python, which starves fast steps of small datasets, so up to ``MATERIALISE_UP_TO`` records an epoch's
permutation is instead drawn once with numpy (keyed by the same ``(seed, epoch)``; a few ms, 4 bytes a
record) and looked up vectorised. Which of the two applies depends on ``N`` alone, so the order is still
the same for every process, device count and restart.

A *position* is the number of stream samples consumed so far. A batch starting at a position never straddles
an epoch: with ``last_batch="drop"`` an epoch's leftover samples (fewer than a batch) are skipped; with
``last_batch="pad"`` the partial batch is filled with samples from the start of the same epoch's order,
weighted 0, and the next batch starts at the next epoch.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
from grain.experimental import index_shuffle

from functrain.errors import DataError

LastBatch = Literal["drop", "pad"]

# Rounds of grain's cipher; grain's own MapDataset.shuffle uses 4.
_SHUFFLE_ROUNDS = 4
# Datasets up to this size materialise each epoch's permutation (16 MiB at most) instead of calling the cipher.
MATERIALISE_UP_TO = 1 << 22


def _epoch_seed(seed: int, epoch: int) -> int:
    """A uint32 cipher key for ``(seed, epoch)``; grain's index shuffle takes 32-bit seeds only.

    Hashing through SeedSequence (rather than ``seed + epoch``) keeps neighbouring seeds from sharing
    the orders of shifted epochs.
    """
    return int(np.random.SeedSequence([seed % 2**64, epoch]).generate_state(1, np.uint32)[0])


class IndexSampler:
    """The global batch order for ``num_records`` records, ``global_batch_size`` per batch.

    Args:
      num_records: dataset size ``N`` (> 0).
      global_batch_size: samples per global batch ``B`` (summed over all processes).
      seed: any int; together with the epoch it keys the permutation.
      shuffle: if False the order is ``0, 1, ..., N-1`` in every epoch.
      last_batch: ``"drop"`` skips an epoch's partial last batch; ``"pad"`` fills it with weight-0 samples.
    """

    def __init__(
        self, num_records: int, global_batch_size: int, seed: int, shuffle: bool = True, last_batch: LastBatch = "drop"
    ) -> None:
        if num_records <= 0:
            raise DataError("the data source is empty (0 records); point data.name/data.path at data with records")
        if global_batch_size <= 0:
            raise DataError(f"data.global_batch_size={global_batch_size} must be positive; set it to 1 or more")
        if last_batch not in ("drop", "pad"):
            raise DataError(f"data.last_batch={last_batch!r} is not 'drop' or 'pad'; set one of those")
        if last_batch == "drop" and global_batch_size > num_records:
            raise DataError(
                f"data.global_batch_size={global_batch_size} is larger than the dataset ({num_records} records) "
                f"with data.last_batch=drop, so every batch would be dropped; lower data.global_batch_size to "
                f"at most {num_records} or set data.last_batch=pad"
            )
        self.num_records = int(num_records)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.last_batch: LastBatch = last_batch
        self._permutations: dict[int, np.ndarray] = {}  # epoch -> permutation, small datasets only
        self._ones = np.ones(self.global_batch_size, np.float32)  # the weights of a batch without filler
        self._ones.flags.writeable = False
        self._permutations_lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"IndexSampler(num_records={self.num_records}, global_batch_size={self.global_batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle}, last_batch={self.last_batch!r})"
        )

    # --- the order -----------------------------------------------------------------------------------------

    def order(self, global_index: int) -> int:
        """The record index at stream index ``global_index`` (epoch ``global_index // N``)."""
        epoch, offset = divmod(int(global_index), self.num_records)
        if not self.shuffle:
            return offset
        if self.num_records <= MATERIALISE_UP_TO:
            return int(self._permutation(epoch)[offset])
        return index_shuffle(offset, self.num_records - 1, _epoch_seed(self.seed, epoch), _SHUFFLE_ROUNDS)

    def _permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s permutation of a small dataset; the two newest are kept (a batch spans at most two).

        Locked: the prefetch thread and the caller's thread may both ask.
        """
        with self._permutations_lock:
            permutation = self._permutations.get(epoch)
            if permutation is None:
                if len(self._permutations) >= 2:
                    del self._permutations[min(self._permutations)]
                rng = np.random.default_rng(_epoch_seed(self.seed, epoch))
                permutation = self._permutations[epoch] = rng.permutation(self.num_records).astype(np.int32)
            return permutation

    def record_indices(self, positions: np.ndarray) -> np.ndarray:
        """Vectorised :meth:`order`: record indices (int64) for an array of stream indices."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.num_records)
        if not self.shuffle:
            return offsets
        out = np.empty_like(offsets)
        max_index = self.num_records - 1
        # A batch spans at most two epochs (the pad wrap stays in one), so the key is computed per epoch.
        for epoch in np.unique(epochs):
            where = epochs == epoch
            if self.num_records <= MATERIALISE_UP_TO:
                out[where] = self._permutation(int(epoch))[offsets[where]]
                continue
            key = _epoch_seed(self.seed, int(epoch))
            out[where] = [index_shuffle(int(o), max_index, key, _SHUFFLE_ROUNDS) for o in offsets[where]]
        return out

    # --- batches -------------------------------------------------------------------------------------------

    def batch_start(self, position: int) -> int:
        """Where the batch served at ``position`` really starts: with "drop", an epoch tail shorter than a
        batch is skipped, so this may be the next epoch's start."""
        position = int(position)
        if position < 0:
            raise DataError(f"data position {position} is negative; use data.skip_samples >= 0")
        remaining = self.num_records - position % self.num_records
        if self.last_batch == "drop" and remaining < self.global_batch_size:
            return position + remaining
        return position

    def batch_positions(self, position: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The stream indices [B] (int64), weights [B] (float32) and next position of the batch at ``position``.

        Stream indices (not record indices) are what per-sample augmentation RNGs are keyed by.
        """
        start = self.batch_start(position)
        epoch_start = start - start % self.num_records
        epoch_end = epoch_start + self.num_records
        size = self.global_batch_size
        stream = np.arange(start, start + size, dtype=np.int64)
        weights = np.ones(size, dtype=np.float32)
        if start + size <= epoch_end:
            return stream, weights, start + size
        # Only "pad" gets here: wrap to the start of this epoch's order, and weight the filler 0.
        overflow = stream >= epoch_end
        stream[overflow] = epoch_start + (stream[overflow] - epoch_end) % self.num_records
        weights[overflow] = 0.0
        return stream, weights, epoch_end

    def batch_at(self, position: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(record_indices [B] int64, weights [B] float32, next_position)`` for the batch at ``position``."""
        _, records, weights, next_position = self.batch_rows(position, 0, self.global_batch_size)
        return records.astype(np.int64), weights, next_position

    def batch_rows(self, position: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Rows ``[first, stop)`` of the batch at ``position``: ``(stream_indices, record_indices, weights,
        next_position)``. The arrays may be read-only views; the next position is the whole batch's.

        A batch that does not reach past its epoch's end (all but a padded last one) is a contiguous run of
        the stream, so a small dataset's rows are a slice of the epoch's permutation: this is the per-step
        path of fast steps, kept free of per-sample work.
        """
        start = self.batch_start(position)
        offset = start % self.num_records
        size = self.global_batch_size
        if offset + size > self.num_records or (self.shuffle and self.num_records > MATERIALISE_UP_TO):
            stream, weights, next_position = self.batch_positions(position)
            return (stream[first:stop], self.record_indices(stream[first:stop]), weights[first:stop], next_position)
        stream = np.arange(start + first, start + stop, dtype=np.int64)
        if self.shuffle:
            records = self._permutation(start // self.num_records)[offset + first : offset + stop]
        else:
            records = stream - (start - offset)
        return stream, records, self._ones[first:stop], start + size

    @property
    def steps_per_epoch(self) -> int:
        """Batches in a whole epoch (started at its beginning): ``N // B`` with "drop", ``ceil(N / B)`` with "pad"."""
        if self.last_batch == "drop":
            return self.num_records // self.global_batch_size
        return -(-self.num_records // self.global_batch_size)

    def epoch_of(self, position: int) -> int:
        """The epoch the next batch at ``position`` comes from (a dropped epoch tail counts as finished)."""
        return self.batch_start(position) // self.num_records

    def steps_until_epoch(self, position: int, epoch: int) -> int:
        """How many batches are served from ``position`` until the stream reaches the start of ``epoch``
        (0 if it is already there); e.g. ``steps_until_epoch(p, train.epochs)`` for an epoch-bounded run."""
        start = self.batch_start(position)
        current = start // self.num_records
        if current >= epoch:
            return 0
        remaining = (current + 1) * self.num_records - start
        if self.last_batch == "drop":
            in_current = remaining // self.global_batch_size
        else:
            in_current = -(-remaining // self.global_batch_size)
        return in_current + (epoch - current - 1) * self.steps_per_epoch

    def position_of_step(self, step: int) -> int:
        """The position of batch ``step`` for a run that started at position 0 with this batch size."""
        epoch, step_in_epoch = divmod(int(step), self.steps_per_epoch)
        return epoch * self.num_records + step_in_epoch * self.global_batch_size

    def extra_meta(self, position: int) -> dict[str, Any]:
        """Checkpoint meta fields beyond the position: none, ``(seed, num_records, batch size)`` fix the order."""
        return {}

    def restore(self, meta: Mapping[str, Any] | None, position: int) -> None:
        """Nothing to restore: the order is a function of the position alone (cf. a mixture's schedule)."""

    def batch_indices(self, step: int) -> np.ndarray:
        """Record indices [B] of batch ``step`` for research code that keeps one batch size from position 0.

        Equal to ``batch_at(position_of_step(step))[0]``. With ``last_batch="pad"`` the epoch's last batch
        holds weight-0 filler; get the weights from ``batch_at(position_of_step(step))[1]``. A run that
        changed its batch size or skipped samples must use positions (:meth:`batch_at`), not steps.
        """
        return self.batch_at(self.position_of_step(step))[0]
