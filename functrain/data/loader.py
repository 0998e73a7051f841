"""Assemble this process's slice of each global batch, ``steps_per_call`` batches at a time.

Process ``p`` of ``P`` builds rows ``[p*B/P, (p+1)*B/P)`` of every global batch, reading only those records,
so the concatenation over processes is exactly the single-process batch, whatever ``P`` is.
Starting at any position costs one batch's work: the batch is a function of the position, never a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from functrain.data.mixture import MixtureSampler
from functrain.data.prefetch import BackgroundIterator
from functrain.data.sampler import IndexSampler
from functrain.data.sources import Batch, as_source
from functrain.data.transforms import Transform, apply_transform
from functrain.data.validate import BatchCheck
from functrain.errors import DataError

# (host batch [K, B/P, ...], start position, end position)
Call = tuple[Any, int, int]


class _Synchronous:
    """The ``prefetch=0`` counterpart of :class:`BackgroundIterator`: same interface, no thread."""

    def __init__(self, source: Generator[Call, None, None]) -> None:
        self._source = source

    def __iter__(self) -> _Synchronous:
        return self

    def __next__(self) -> Call:
        return next(self._source)

    def close(self) -> None:
        """Release the underlying generator."""
        self._source.close()

    def __enter__(self) -> _Synchronous:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# What iter_from returns: calls assembled in a thread, or in the caller's (prefetch=0); closeable either way.
Calls = BackgroundIterator[Call] | _Synchronous


def batch_split_problem(
    global_batch_size: int, micro_batches: int = 1, ways: int = 1, what: str = "processes"
) -> str | None:
    """The one rule for splitting a global batch, or what breaks it: it must divide by ``micro_batches`` times
    the ``ways`` it is split (processes, or data-parallel devices)."""
    divisor = micro_batches * ways
    if global_batch_size % divisor == 0:
        return None
    parts = ([f"train.micro_batches={micro_batches}"] if micro_batches > 1 else []) + (
        [f"the {ways} {what}"] if ways > 1 else []
    )
    return (
        f"data.global_batch_size={global_batch_size} is not divisible by {' x '.join(parts)}; set it to a "
        f"multiple of {divisor}"
    )


def local_batch_size(global_batch_size: int, process_index: int, process_count: int) -> int:
    """The rows of each global batch that process ``process_index`` of ``process_count`` loads; a DataError
    (one line) for an index outside the job or a batch the processes cannot share evenly."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(
            f"process_index={process_index} is not in [0, process_count={process_count}); "
            f"pass jax.process_index() and jax.process_count()"
        )
    problem = batch_split_problem(global_batch_size, ways=process_count)
    if problem:
        raise DataError(problem)
    return global_batch_size // process_count


class BatchLoader:
    """Builds this process's part of the global batches chosen by ``sampler`` from ``source``.

    Args:
      source: a dict of arrays, a :class:`~functrain.data.sources.Source`, or any map-style dataset
        (see :func:`~functrain.data.sources.as_source`); its length must equal ``sampler.num_records``.
      sampler: the global order.
      process_index, process_count: this process's place (``jax.process_index()``, ``jax.process_count()``).
      transform: optional per-record ``transform(record, rng) -> record``, RNG keyed by ``(seed, stream index)``.
      prefetch: calls assembled ahead in a background thread; 0 assembles in the caller's thread.
      transform_seed: seed for the transform RNGs; defaults to ``sampler.seed``.
      keys: field names for tuple records of a map-style dataset (e.g. ``("x", "y")``).
      check: validates each batch as it is assembled (what the model reads, in range); see
        :mod:`functrain.data.validate`.

    Every batch gets ``"weight"``: float32 [B/P], 1 for real samples and 0 for "pad" filler (multiplied into a
    ``"weight"`` field the source already has).
    """

    def __init__(
        self,
        source: Any,
        sampler: IndexSampler | MixtureSampler,
        process_index: int = 0,
        process_count: int = 1,
        transform: Transform | None = None,
        prefetch: int = 2,
        transform_seed: int | None = None,
        keys: tuple[str, ...] | None = None,
        check: BatchCheck | None = None,
    ) -> None:
        self.source = as_source(source, keys=keys)
        self.check = check
        self.sampler = sampler
        if len(self.source) != sampler.num_records:
            raise DataError(
                f"the data source has {len(self.source)} records but the sampler was built for "
                f"{sampler.num_records}; build the IndexSampler with num_records=len(source)"
            )
        if prefetch < 0:
            raise DataError(f"data.prefetch={prefetch} is negative; set 0 (synchronous) or more")
        self.process_index = process_index
        self.process_count = process_count
        self.local_batch_size = local_batch_size(sampler.global_batch_size, process_index, process_count)
        self.transform = transform
        self.transform_seed = sampler.seed if transform_seed is None else transform_seed
        self.prefetch = prefetch

    def host_batch(self, position: int) -> tuple[Batch, int]:
        """This process's rows of the batch at ``position`` (with ``"weight"``) and the next position."""
        first = self.process_index * self.local_batch_size
        stream, records, weights, next_position = self.sampler.batch_rows(
            position, first, first + self.local_batch_size
        )
        batch = self.source.gather(records)
        if self.transform is not None:
            batch = apply_transform(batch, self.transform, self.transform_seed, stream)
        if self.check is not None:
            self.check(batch, records)
        batch = dict(batch)
        batch["weight"] = weights * batch["weight"].astype(np.float32) if "weight" in batch else weights
        return batch, next_position

    def iter_from(
        self,
        position: int,
        steps_per_call: int = 1,
        num_steps: int | None = None,
        place: Callable[[Batch], Any] | None = None,
        first_call_steps: int | None = None,
    ) -> Calls:
        """Yield ``(host_batch, start_position, end_position)`` from ``position`` on.

        ``host_batch`` is a dict of arrays ``[K, B/P, ...]`` with ``K = steps_per_call``; ``end_position`` is the
        position to store as ``samples_consumed`` once those K steps are done. With ``num_steps`` the iterator
        stops after that many batches (the last call holds fewer than K if they do not divide); without, it
        never ends. ``place`` (e.g. ``lambda b: to_global(b, mesh)``) runs on each call in the prefetch thread.
        ``first_call_steps`` makes the first call shorter, e.g. to bring calls back onto multiples of K after a
        resume from a step that is not one.
        The result is closeable (``close()`` or ``with``), which stops the prefetch thread.
        """
        self.sampler.batch_start(position)  # validates the position before a thread is started
        return start_calls(
            self.host_batch, int(position), steps_per_call, num_steps, place, first_call_steps, self.prefetch
        )


class StreamEnded(Exception):
    """Raised by a loader's ``host_batch`` when its source has no whole batch left (a finite stream)."""


def stacked_calls(
    host_batch: Callable[[int], tuple[Batch, int]],
    position: int,
    steps_per_call: int,
    num_steps: int | None,
    place: Callable[[Batch], Any] | None,
    first_call_steps: int | None,
) -> Generator[Call, None, None]:
    """Calls of ``steps_per_call`` batches from ``host_batch``, stacked on a new leading axis; a source that
    ends (:class:`StreamEnded`) ends the calls after its last whole batch."""
    steps_left = num_steps
    call_steps = first_call_steps or steps_per_call
    while steps_left is None or steps_left > 0:
        steps = call_steps if steps_left is None else min(call_steps, steps_left)
        call_steps = steps_per_call
        start = position
        batches, ended = [], False
        try:
            for _ in range(steps):
                batch, position = host_batch(position)
                batches.append(batch)
        except StreamEnded:
            ended = True
        if not batches:
            return
        if len(batches) == 1:  # a view, no copy: one step per call is the latency-bound case
            stacked = {name: value[None] for name, value in batches[0].items()}
        else:
            stacked = {name: np.stack([batch[name] for batch in batches]) for name in batches[0]}
        yield (place(stacked) if place is not None else stacked), start, position
        if ended:
            return
        if steps_left is not None:
            steps_left -= steps


def start_calls(
    host_batch: Callable[[int], tuple[Batch, int]],
    position: int,
    steps_per_call: int,
    num_steps: int | None,
    place: Callable[[Batch], Any] | None,
    first_call_steps: int | None,
    prefetch: int,
) -> Calls:
    """:func:`stacked_calls`, run ``prefetch`` calls ahead in a thread (0: in the caller's thread)."""
    if steps_per_call < 1:
        raise DataError(f"train.steps_per_call={steps_per_call} must be at least 1")
    calls = stacked_calls(host_batch, position, steps_per_call, num_steps, place, first_call_steps)
    if prefetch == 0:
        return _Synchronous(calls)
    return BackgroundIterator(calls, prefetch)
