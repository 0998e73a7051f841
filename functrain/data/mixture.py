"""Mixtures: samples drawn from several sources in fixed proportions, as a pure function of ``(seed, position)``.

The stream is cut into blocks of ``block_size`` samples. In every block source ``k`` owns ``quota_k`` slots
(largest-remainder rounding of ``weight_k * block_size``), scattered by a permutation keyed by ``(seed,
segment, block)``. The sample in slot ``j`` of block ``b`` is item ``offset_k + b * quota_k + rank`` of source
``k``'s own stream (``rank``: how many of ``k``'s slots come before ``j`` in the block), and that stream is read
through an :class:`~functrain.data.sampler.IndexSampler` order (a permutation per pass over the source). So any
position is located with one block permutation and one per-source lookup: resuming is arithmetic at any
position, and the proportions are exact in every block, the same for any number of processes.

A *data schedule* changes the weights at a resume. The order is then a list of segments ``(start position,
weights, per-source offsets)``: a new segment starts where the weights changed, its offsets are what each
source had served by then, so every source continues where it stopped and nothing already seen repeats
(until a source wraps into its next pass). The segments go into the checkpoint meta (``"mixture"``).
"""

from __future__ import annotations

import functools
import numbers
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from functrain.data.sampler import IndexSampler
from functrain.data.sources import Batch, Source, as_source
from functrain.errors import DataError

DEFAULT_BLOCK_SIZE = 1024


class ConcatSource:
    """Sources one after the other in one index space: record ``offsets[k] + r`` is record ``r`` of source ``k``.

    Every source must give the same fields, dtypes and per-record shapes (checked on one record of each).
    """

    def __init__(self, sources: Sequence[Any], names: Sequence[str] | None = None) -> None:
        if not sources:
            raise DataError("a mixture needs at least one source; list them in data.sources")
        self.names = (
            [str(name) for name in names] if names is not None else [f"source {k}" for k in range(len(sources))]
        )
        self.sources: list[Source] = [as_source(source) for source in sources]
        self.sizes = np.array([len(source) for source in self.sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self._check_same_records()

    def _check_same_records(self) -> None:
        first = self.sources[0].gather(np.arange(1))
        layout = {name: (value.dtype, value.shape[1:]) for name, value in first.items()}
        for name, source in zip(self.names[1:], self.sources[1:]):
            other = {field: (value.dtype, value.shape[1:]) for field, value in source.gather(np.arange(1)).items()}
            if other != layout:
                raise DataError(
                    f"mixture source {name} has records {_describe(other)} but {self.names[0]} has "
                    f"{_describe(layout)}; mix sources with the same fields, dtypes and shapes "
                    f"(e.g. the same data.seq_len)"
                )

    def __len__(self) -> int:
        return int(self.sizes.sum())

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source numbers, record indices within the source)`` of global record indices."""
        indices = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self.offsets, indices, side="right") - 1
        return which, indices - self.offsets[which]

    def gather(self, indices: np.ndarray) -> Batch:
        """Records ``indices`` (global), one gather per source, in the order asked."""
        which, local = self.locate(indices)
        parts = {k: self.sources[k].gather(local[which == k]) for k in np.unique(which)}
        if not parts:
            return {name: value[:0] for name, value in self.sources[0].gather(np.arange(1)).items()}
        names = next(iter(parts.values())).keys()
        out = {}
        for name in names:
            sample = next(iter(parts.values()))[name]
            column = np.empty((len(which), *sample.shape[1:]), dtype=sample.dtype)
            for k, part in parts.items():
                column[which == k] = part[name]
            out[name] = column
        return out


def _describe(layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]]) -> str:
    return "{" + ", ".join(f"{name}: {dtype}{list(shape)}" for name, (dtype, shape) in layout.items()) + "}"


class Mixture(ConcatSource):
    """``Mixture([(source, weight), ...])``: draw from each source in proportion to its weight.

    Pass it as ``fit(train_data=Mixture(...))`` (the config form is ``data.sources: [{path, weight}, ...]``).
    Sources are anything :func:`~functrain.data.sources.as_source` takes; weights are positive numbers (only
    their ratios matter). ``block_size`` is the span over which the proportions are exact. Changing the
    weights between runs of one run directory continues every source where it stopped (a data schedule).
    """

    def __init__(
        self,
        components: Sequence[tuple[Any, float]],
        block_size: int = DEFAULT_BLOCK_SIZE,
        names: Sequence[str] | None = None,
    ) -> None:
        components = list(components)
        names = list(names) if names is not None else [f"source {k}" for k in range(len(components))]
        for name, component in zip(names, components):
            if not isinstance(component, tuple) or len(component) != 2:
                raise DataError(
                    f"mixture {name} is a {type(component).__name__}, not a (source, weight) pair; "
                    f"write Mixture([(source, weight), ...])"
                )
            weight = component[1]
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not weight > 0:
                raise DataError(
                    f"mixture {name} has weight {weight!r}; weights must be numbers > 0 (their "
                    f"ratios are the proportions): give it a positive weight or remove the source"
                )
        if block_size < len(components):
            raise DataError(
                f"mixture block_size={block_size} is smaller than the {len(components)} sources; "
                f"use a block_size of at least {len(components)}"
            )
        super().__init__([source for source, _ in components], names)
        self.weights = tuple(float(weight) for _, weight in components)
        self.block_size = int(block_size)
        quota = quotas(self.weights, self.block_size)
        if not quota.all():
            name = self.names[int(np.flatnonzero(quota == 0)[0])]
            raise DataError(
                f"mixture {name} gets no sample in a block of {self.block_size} (its weight is below "
                f"1/{2 * self.block_size} of the total); raise its weight or the block_size"
            )


def quotas(weights: Sequence[float], block_size: int) -> np.ndarray:
    """Slots per block for each source: ``weight * block_size / total`` rounded by largest remainder, so the
    quotas sum to ``block_size`` exactly (ties go to the earlier source)."""
    shares = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * block_size
    quota = np.floor(shares).astype(np.int64)
    remainders = shares - quota
    order = np.argsort(-remainders, kind="stable")
    quota[order[: block_size - int(quota.sum())]] += 1
    return quota


@functools.lru_cache(maxsize=16)
def _block(seed: int, segment: int, block: int, quota: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Block ``block`` of segment ``segment``: the source of each slot and the slot's rank among that source's
    slots in the block. Cached: a batch touches one or two blocks, and consecutive batches share them."""
    labels = np.repeat(np.arange(len(quota)), quota)
    labels = labels[np.random.default_rng([seed % 2**63, segment, block]).permutation(len(labels))]
    by_source = np.argsort(labels, kind="stable")
    starts = np.concatenate([[0], np.cumsum(quota)[:-1]])
    ranks = np.empty_like(labels)
    ranks[by_source] = np.arange(len(labels)) - starts[labels[by_source]]
    labels.flags.writeable = ranks.flags.writeable = False
    return labels, ranks


@dataclass(frozen=True)
class Segment:
    """A stretch of the stream with one set of weights: from position ``start`` on, source ``k``'s items
    continue at ``offsets[k]``."""

    start: int
    quota: tuple[int, ...]
    offsets: tuple[int, ...]
    weights: tuple[float, ...]

    def as_meta(self) -> dict[str, Any]:
        return {
            "start": self.start,
            "weights": list(self.weights),
            "quota": list(self.quota),
            "offsets": list(self.offsets),
        }


class MixtureSampler:
    """The global batch order of a :class:`Mixture`: the same interface as
    :class:`~functrain.data.sampler.IndexSampler` (what :class:`~functrain.data.loader.BatchLoader` and the
    loop use), with record indices in the mixture's concatenated index space.

    There are no mixture epochs: ``epoch_of`` counts passes of ``len(mixture)`` samples, for logs and
    ``train.epochs``; each source reshuffles on its own passes (``shuffle=False``: each source in record order,
    the slots of a block still scattered).
    """

    def __init__(self, mixture: Mixture, global_batch_size: int, seed: int, shuffle: bool = True) -> None:
        if global_batch_size <= 0:
            raise DataError(f"data.global_batch_size={global_batch_size} must be positive; set it to 1 or more")
        self.mixture = mixture
        self.num_records = len(mixture)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.block_size = mixture.block_size
        # Each source has its own order (its own permutation per pass), keyed by the seed and its number.
        self.source_orders = [
            IndexSampler(
                int(size), 1, int(np.random.SeedSequence([self.seed % 2**63, k]).generate_state(1)[0]), shuffle=shuffle
            )
            for k, size in enumerate(mixture.sizes)
        ]
        self.segments = [self._segment(0, (0,) * len(mixture.sizes))]
        self._lock = threading.Lock()  # restore() replaces the segments; readers (prefetch thread) copy them

    def _segment(self, start: int, offsets: tuple[int, ...]) -> Segment:
        return Segment(
            int(start),
            tuple(int(q) for q in quotas(self.mixture.weights, self.block_size)),
            tuple(int(o) for o in offsets),
            self.mixture.weights,
        )

    # --- the order -----------------------------------------------------------------------------------------

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source numbers, item numbers in each source's own stream)`` of stream positions."""
        positions = np.asarray(positions, dtype=np.int64)
        with self._lock:
            segments = list(self.segments)
        starts = np.array([segment.start for segment in segments], dtype=np.int64)
        which_segment = np.searchsorted(starts, positions, side="right") - 1
        sources = np.empty_like(positions)
        items = np.empty_like(positions)
        for s in np.unique(which_segment):
            segment = segments[s]
            local = positions[which_segment == s] - segment.start
            blocks, slots = np.divmod(local, self.block_size)
            quota = np.asarray(segment.quota)
            for block in np.unique(blocks):
                labels, ranks = _block(self.seed, int(s), int(block), segment.quota)
                in_block = blocks == block
                where = np.flatnonzero(which_segment == s)[in_block]
                k = labels[slots[in_block]]
                sources[where] = k
                items[where] = np.asarray(segment.offsets)[k] + int(block) * quota[k] + ranks[slots[in_block]]
        return sources, items

    def sources_and_records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(source numbers, record indices within each source)`` of stream positions."""
        sources, items = self.locate(positions)
        records = np.empty_like(items)
        for k in np.unique(sources):
            records[sources == k] = self.source_orders[k].record_indices(items[sources == k])
        return sources, records

    def record_indices(self, positions: np.ndarray) -> np.ndarray:
        """Record indices in the mixture's concatenated index space (what ``Mixture.gather`` takes)."""
        sources, records = self.sources_and_records(positions)
        return self.mixture.offsets[sources] + records

    def consumed(self, position: int) -> tuple[int, ...]:
        """How many items each source has served before stream position ``position``."""
        with self._lock:
            segment = [s for s in self.segments if s.start <= position][-1]
            index = self.segments.index(segment)
        full, partial = divmod(int(position) - segment.start, self.block_size)
        counts = full * np.asarray(segment.quota, dtype=np.int64)
        if partial:
            labels, _ = _block(self.seed, index, full, segment.quota)
            counts = counts + np.bincount(labels[:partial], minlength=len(segment.quota))
        return tuple(int(o + c) for o, c in zip(segment.offsets, counts))

    # --- batches (the IndexSampler interface) --------------------------------------------------------------

    def batch_start(self, position: int) -> int:
        """Batches start wherever the position is: a mixture has no epoch tails to skip."""
        position = int(position)
        if position < 0:
            raise DataError(f"data position {position} is negative; use data.skip_samples >= 0")
        return position

    def batch_rows(self, position: int, first: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Rows ``[first, stop)`` of the batch at ``position``: ``(stream_indices, record_indices, weights,
        next_position)``."""
        start = self.batch_start(position)
        stream = np.arange(start + first, start + stop, dtype=np.int64)
        return stream, self.record_indices(stream), np.ones(len(stream), np.float32), start + self.global_batch_size

    def batch_at(self, position: int) -> tuple[np.ndarray, np.ndarray, int]:
        """``(record_indices [B], weights [B], next_position)`` for the batch at ``position``."""
        _, records, weights, next_position = self.batch_rows(position, 0, self.global_batch_size)
        return records, weights, next_position

    @property
    def steps_per_epoch(self) -> int:
        """Batches in ``len(mixture)`` samples (what ``train.epochs`` counts)."""
        return max(1, self.num_records // self.global_batch_size)

    def epoch_of(self, position: int) -> int:
        """Passes of ``len(mixture)`` samples completed before ``position``."""
        return self.batch_start(position) // self.num_records

    # --- the data schedule in the checkpoint ---------------------------------------------------------------

    def extra_meta(self, position: int) -> dict[str, Any]:
        """The mixture's fields of a checkpoint meta: the sources, block size and segments up to ``position``."""
        with self._lock:
            segments = [segment.as_meta() for segment in self.segments if segment.start <= position]
        return {
            "mixture": {
                "sources": list(self.mixture.names),
                "sizes": [int(n) for n in self.mixture.sizes],
                "block_size": self.block_size,
                "segments": segments,
                "consumed": list(self.consumed(position)),
            }
        }

    def restore(self, meta: Mapping[str, Any] | None, position: int) -> None:
        """Continue the schedule a checkpoint recorded: its segments up to ``position``, then (when the weights
        changed) a new segment at ``position`` that starts each source where it stopped. Sources added after the
        recorded ones start at their beginning. Without a recorded mixture (``meta`` None, or a checkpoint of
        other data) the order starts fresh with these weights."""
        saved = (meta or {}).get("mixture")
        if not saved:
            return
        sizes = [int(n) for n in self.mixture.sizes]
        saved_sizes = [int(n) for n in saved["sizes"]]
        how = "or set data.ignore_skip=true to restart the data (model and optimizer are kept)"
        if sizes[: len(saved_sizes)] != saved_sizes:
            raise DataError(
                f"the checkpoint mixed sources of {saved_sizes} records, the mixture now has {sizes}; "
                f"keep those sources first and in order (change their weights, add new ones after) "
                f"{how}"
            )
        if int(saved["block_size"]) != self.block_size:
            raise DataError(
                f"the checkpoint's mixture used block_size={saved['block_size']}, now "
                f"{self.block_size}; keep block_size={saved['block_size']} {how}"
            )
        added = (0,) * (len(sizes) - len(saved_sizes))  # a new source has no slots in earlier segments
        segments = [
            Segment(
                int(s["start"]),
                tuple(s["quota"]) + added,
                tuple(s["offsets"]) + added,
                tuple(s["weights"]) + (0.0,) * len(added),
            )
            for s in saved["segments"]
            if int(s["start"]) <= position
        ]
        with self._lock:
            self.segments = segments
        if segments[-1].quota != self._segment(0, ()).quota:
            offsets = self.consumed(position)
            with self._lock:
                if segments[-1].start == position:  # nothing served since that segment began: replace it
                    segments = segments[:-1]
                self.segments = segments + [self._segment(position, offsets)]
