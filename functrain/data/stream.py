"""Streaming sources: data read front to back (an HF ``datasets.IterableDataset``, a generator function, any
re-iterable object), for corpora that are not random access.

Sharding (Accelerate's ``IterableDatasetShard``): every process reads the same stream and keeps rows
``[p*B/P, (p+1)*B/P)`` of each global batch of ``B`` consecutive records. So the global batch sequence is
the stream's order, the same for any number of processes, and the position (records consumed) is one
number shared by all; the price is that each process reads all ``B`` records of a batch.

Resume. The checkpoint meta records the position and, for an object with ``state_dict()`` /
``load_state_dict()`` (HF ``IterableDataset``: shard and offset within it), its state after exactly that
many records, so a restart continues at the next record without reading the earlier ones. A function with a
``start`` parameter (``def records(start=0): ...``) is called with the position: O(1) too. Anything else (a function
of nothing, a list, a torch ``IterableDataset``) is read from its start and the records before the position
are skipped (read and dropped, never trained on).

What holds: the records trained on are exactly the stream's, in its order, with no record repeated or
skipped across a SIGKILL and resume; a deterministic stream (and an HF dataset without a shuffle buffer)
resumes bitwise. What does not: no shuffling beyond what the stream does itself (HF
``ds.shuffle(buffer_size=...)``; on resume HF refills the buffer, so the order after a restart differs);
no epoch length is known in advance (``train.max_steps`` is required, ``train.epochs`` is not possible);
when the stream ends the run stops after the last whole batch; a one-shot iterator cannot be reopened and is
refused; per-record transforms and evaluation streams are not supported (evaluation data is random access).
"""

from __future__ import annotations

import inspect
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from functrain.data.loader import Calls, StreamEnded, local_batch_size, start_calls
from functrain.data.sources import Batch, record_dict, stack_records
from functrain.data.validate import BatchCheck
from functrain.errors import DataError

# Stream states kept per position (a checkpoint asks for one a few calls behind the reader).
_STATES_KEPT = 4096


def is_stream(data: Any) -> bool:
    """Whether ``data`` is read front to back: iterable or a function, but not map-style (len + getitem)."""
    if isinstance(data, Stream):
        return True
    map_style = hasattr(data, "__len__") and hasattr(data, "__getitem__")
    return not map_style and not isinstance(data, Mapping) and (hasattr(data, "__iter__") or callable(data))


class Stream:
    """A streaming source: ``Stream(data, keys=None)``.

    ``data`` is an object with ``state_dict()``/``load_state_dict()`` and ``__iter__`` (HF
    ``IterableDataset``), a function returning an iterator (called as ``f(start=offset)`` when it has a
    ``start`` parameter, else ``f()``), or a re-iterable object. Records are dicts of array-likes (or tuples
    named by ``keys``).
    """

    def __init__(self, data: Any, keys: Sequence[str] | None = None) -> None:
        if isinstance(data, Iterator):
            raise DataError(
                f"train_data is a one-shot {type(data).__name__}, which cannot be reopened on resume; "
                f"pass the function that makes it (e.g. train_data=make_records, not make_records())"
            )
        self.data = data
        self.keys = tuple(keys) if keys is not None else None
        self.stateful = hasattr(data, "state_dict") and hasattr(data, "load_state_dict") and hasattr(data, "__iter__")
        self.takes_start = not hasattr(data, "__iter__") and callable(data) and _takes_start(data)
        named = getattr(data, "func", data)  # a functools.partial (data.target with kwargs): its function
        self.name = getattr(named, "__qualname__", type(data).__name__)

    def open(self, start: int, state: Any = None) -> StreamReader:
        """A reader at record ``start``: from ``state`` (the stream's state after ``start`` records) when given,
        else by the start offset, else by skipping ``start`` records."""
        if self.stateful:
            # load_state_dict(None) clears a state loaded earlier, so the stream starts at its beginning.
            self.data.load_state_dict(state)
            iterator, skip = iter(self.data), (0 if state is not None else start)
        elif self.takes_start:
            iterator, skip = self.data(start=start), 0
        elif hasattr(self.data, "__iter__"):
            iterator, skip = iter(self.data), start
        else:
            iterator, skip = self.data(), start
        if not isinstance(iterator, Iterator):
            raise DataError(
                f"train_data {self.name} returned a {type(iterator).__name__}, not an iterator; "
                f"make it a generator (yield records) or return iter(...)"
            )
        for _ in itertools.islice(iterator, skip):
            pass
        return StreamReader(self, iterator)

    def gather(self, indices: np.ndarray) -> Batch:
        """Records ``indices`` read from the stream's start: for a first look at the fields, not for training."""
        indices = np.asarray(indices, dtype=np.int64)
        reader = self.open(0)
        records = reader.take(int(indices.max()) + 1)
        if len(records) <= indices.max():
            raise DataError(f"train_data {self.name} has only {len(records)} records; give it more data")
        return stack_records([record_dict(records[i], self.keys, f"a record of {self.name}") for i in indices])


def _takes_start(factory: Callable) -> bool:
    try:
        return "start" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


class StreamReader:
    """An open stream: takes records in order and tells the stream's state after them."""

    def __init__(self, stream: Stream, iterator: Iterator) -> None:
        self.stream = stream
        self.iterator = iterator

    def take(self, count: int) -> list[Any]:
        """The next ``count`` records (fewer when the stream ends)."""
        return list(itertools.islice(self.iterator, count))

    def state(self) -> Any:
        """The stream's state after the records taken (None: it has none; resume by offset or skipping)."""
        return self.stream.data.state_dict() if self.stream.stateful else None


class StreamOrder:
    """The order of a stream: batch ``i`` of a run is records ``[p, p + B)`` at position ``p``. It also keeps
    the stream's state at recent positions, for the checkpoint, and the state to resume from.

    Same interface as :class:`~functrain.data.sampler.IndexSampler` where the loop uses it; there are no epochs.
    """

    num_records = None

    def __init__(self, global_batch_size: int, seed: int) -> None:
        if global_batch_size <= 0:
            raise DataError(f"data.global_batch_size={global_batch_size} must be positive; set it to 1 or more")
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self._states: OrderedDict[int, Any] = OrderedDict()
        self._lock = threading.Lock()  # the reader records states in the prefetch thread; saves read them

    def batch_start(self, position: int) -> int:
        position = int(position)
        if position < 0:
            raise DataError(f"data position {position} is negative; use data.skip_samples >= 0")
        return position

    def epoch_of(self, position: int) -> int:
        """Always 0: a stream's length is unknown."""
        return 0

    @property
    def steps_per_epoch(self) -> int:
        raise DataError("a streaming train_data has no known epoch length; set train.max_steps instead of train.epochs")

    def record_state(self, position: int, state: Any) -> None:
        """Remember the stream's state after ``position`` records."""
        if state is None:
            return
        with self._lock:
            self._states[int(position)] = state
            while len(self._states) > _STATES_KEPT:
                self._states.popitem(last=False)

    def state_at(self, position: int) -> Any:
        """The stream's state after ``position`` records, if known."""
        with self._lock:
            return self._states.get(int(position))

    def extra_meta(self, position: int) -> dict[str, Any]:
        """The checkpoint's ``stream`` field: records consumed and the stream's state there."""
        return {"stream": {"records_consumed": int(position), "state": self.state_at(position)}}

    def restore(self, meta: Mapping[str, Any] | None, position: int) -> None:
        """Take the stream state a checkpoint recorded for ``position`` (if it did, and is at that position)."""
        saved = (meta or {}).get("stream") or {}
        if saved.get("state") is not None and int(saved.get("records_consumed", -1)) == int(position):
            self.record_state(position, saved["state"])


class StreamLoader:
    """:class:`~functrain.data.loader.BatchLoader`'s interface over a :class:`Stream`: every process reads each
    global batch's ``B`` records and keeps its ``B/P`` rows."""

    def __init__(
        self,
        stream: Stream,
        order: StreamOrder,
        process_index: int = 0,
        process_count: int = 1,
        prefetch: int = 2,
        check: BatchCheck | None = None,
    ) -> None:
        self.source = self.stream = stream
        self.sampler = self.order = order
        self.process_index, self.process_count = process_index, process_count
        self.local_batch_size = local_batch_size(order.global_batch_size, process_index, process_count)
        self.prefetch = prefetch
        self.check = check
        self._reader: StreamReader | None = None
        self._position = -1  # where the open reader stands

    def host_batch(self, position: int) -> tuple[Batch, int]:
        """This process's rows of the batch at ``position`` and the next position. Consecutive positions read
        on; any other reopens the stream (from a recorded state when there is one)."""
        position = self.order.batch_start(position)
        if self._reader is None or self._position != position:
            self._reader = self.stream.open(position, self.order.state_at(position))
            self._position = position
        size = self.order.global_batch_size
        records = self._reader.take(size)
        if len(records) < size:
            self._reader = None
            if position == 0:
                raise DataError(
                    f"train_data {self.stream.name} has {len(records)} records, fewer than one batch "
                    f"(data.global_batch_size={size}); give it more data or lower the batch size"
                )
            raise StreamEnded(position)
        self._position = position + size
        self.order.record_state(self._position, self._reader.state())
        first = self.process_index * self.local_batch_size
        what = f"record {{}} of {self.stream.name}"
        batch = stack_records(
            [
                record_dict(record, self.stream.keys, what.format(position + first + i))
                for i, record in enumerate(records[first : first + self.local_batch_size])
            ]
        )
        if self.check is not None:
            self.check(batch, np.arange(position + first, position + first + self.local_batch_size))
        ones = np.ones(self.local_batch_size, np.float32)
        batch["weight"] = batch["weight"].astype(np.float32) if "weight" in batch else ones
        return batch, self._position

    def iter_from(
        self,
        position: int,
        steps_per_call: int = 1,
        num_steps: int | None = None,
        place: Callable[[Batch], Any] | None = None,
        first_call_steps: int | None = None,
    ) -> Calls:
        """As :meth:`BatchLoader.iter_from <functrain.data.loader.BatchLoader.iter_from>`; the calls end early
        when the stream does."""
        self.order.batch_start(position)
        return start_calls(
            self.host_batch, int(position), steps_per_call, num_steps, place, first_call_steps, self.prefetch
        )
