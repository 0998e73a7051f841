"""Random-access data sources: anything that can hand over records by index, gathered a batch at a time.

A *source* has ``__len__`` and ``gather(indices) -> {name: array [len(indices), ...]}``. Two kinds exist:

- :class:`ArraySource` over a dict of equally long arrays (numpy arrays, ``np.load(..., mmap_mode="r")``
  memmaps): one fancy-indexing gather per field, no per-record Python work.
- :class:`RecordSource` over any object with ``__len__`` and ``__getitem__(i)`` returning a record (a dict of
  array-likes, or a tuple named by ``keys``): a torch ``Dataset``, an HF ``datasets.Dataset``, a grain data
  source. It uses the object's batched ``__getitems__`` when present (torch and HF both define it).

:func:`as_source` picks the right one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from functrain.errors import DataError

Batch = dict[str, np.ndarray]


@runtime_checkable
class Source(Protocol):
    """What the loader needs from data: a length and a batched gather by record index."""

    def __len__(self) -> int: ...

    def gather(self, indices: np.ndarray) -> Batch:
        """Records ``indices`` stacked along a new leading axis, one array per field."""
        ...


class ArraySource:
    """Records stored as rows of equally long arrays, e.g. ``ArraySource({"x": x, "y": y})``."""

    def __init__(self, arrays: Mapping[str, Any]) -> None:
        if not arrays:
            raise DataError("the array data source has no fields; pass a dict such as {'x': x, 'y': y}")
        # np.asarray keeps memmaps as memmaps (no read) and turns lists into arrays.
        self.arrays = {
            name: value if isinstance(value, np.ndarray) else np.asarray(value) for name, value in arrays.items()
        }
        lengths = {name: (value.shape[0] if value.ndim else None) for name, value in self.arrays.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise DataError(
                f"the data fields have different numbers of records {lengths}; give every field the same leading length"
            )
        self._length = len(next(iter(self.arrays.values())))  # the common length: every field has one
        if self._length == 0:
            raise DataError(
                f"the data source is empty (fields {sorted(self.arrays)} have 0 records); "
                f"point data.name/data.path at data with records"
            )

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Batch:
        return {name: value[index] for name, value in self.arrays.items()}

    def gather(self, indices: np.ndarray) -> Batch:
        """One fancy-indexing read per field (a copy, also for memmaps)."""
        return {name: np.asarray(value[indices]) for name, value in self.arrays.items()}


class RecordSource:
    """Adapter for a random-access object whose ``__getitem__(i)`` returns one record.

    Args:
      records: the object (torch ``Dataset``, HF ``datasets.Dataset``, grain data source, ...).
      keys: field names for records that are tuples or lists, e.g. ``("x", "y")`` for torchvision-style
        ``(image, label)`` pairs, or one name for bare values. Records that are dicts need none.
    """

    def __init__(self, records: Any, keys: Sequence[str] | None = None) -> None:
        if not (hasattr(records, "__len__") and hasattr(records, "__getitem__")):
            raise DataError(
                f"{type(records).__name__} is not a random-access data source; give an object with "
                f"__len__ and __getitem__ (a map-style dataset), or a dict of arrays"
            )
        if len(records) == 0:
            raise DataError(
                f"the data source {type(records).__name__} is empty (0 records); point "
                f"data.name/data.path at data with records"
            )
        self.records = records
        self.keys = tuple(keys) if keys is not None else None

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> Batch:
        return self._as_dict(self.records[int(index)])

    def gather(self, indices: np.ndarray) -> Batch:
        """Fetch the records (batched when the object supports it) and stack each field."""
        index_list = [int(i) for i in indices]
        getitems = getattr(self.records, "__getitems__", None)
        raw = getitems(index_list) if getitems is not None else [self.records[i] for i in index_list]
        if isinstance(raw, Mapping):  # HF datasets may answer a batched read with columns
            return {name: np.asarray(column) for name, column in raw.items()}
        return stack_records([self._as_dict(record) for record in raw])

    def _as_dict(self, record: Any) -> Batch:
        return record_dict(record, self.keys, f"a record of {type(self.records).__name__}")


def record_dict(record: Any, keys: Sequence[str] | None, what: str) -> Batch:
    """A record as a dict of arrays: a dict as is, a tuple named by ``keys``, a bare value as ``keys[0]``."""
    if isinstance(record, Mapping):
        return {name: np.asarray(value) for name, value in record.items()}
    if keys is not None and isinstance(record, (tuple, list)) and len(record) == len(keys):
        return {name: np.asarray(value) for name, value in zip(keys, record)}
    if keys is not None and len(keys) == 1:  # a bare value, e.g. grain's RangeDataSource
        return {keys[0]: np.asarray(record)}
    raise DataError(
        f"{what} is a {type(record).__name__}, not a dict; return dicts of arrays or pass "
        f"keys=('x', 'y') to name tuple fields"
    )


def stack_records(records: Sequence[Mapping[str, Any]]) -> Batch:
    """Stack a list of record dicts into one dict of arrays with a leading batch axis."""
    names = list(records[0])
    for record in records:
        if list(record) != names:
            raise DataError(
                f"records have different fields ({names} vs {list(record)}); make every record return the same keys"
            )
    stacked = {}
    for name in names:
        values = [np.asarray(record[name]) for record in records]
        shapes = {value.shape for value in values}
        if len(shapes) > 1:
            raise DataError(
                f"records have field {name!r} of different shapes {sorted(shapes)[:4]}; pad or crop "
                f"every record to one shape (e.g. to data.seq_len) before training"
            )
        stacked[name] = np.stack(values)
    return stacked


def as_source(data: Any, keys: Sequence[str] | None = None) -> Source:
    """Wrap ``data`` as a :class:`Source`: a dict of arrays becomes an :class:`ArraySource`, an object that
    already has ``gather`` is used as is, any other map-style dataset becomes a :class:`RecordSource`."""
    if isinstance(data, Mapping):
        return ArraySource(data)
    if hasattr(data, "gather") and hasattr(data, "__len__"):
        if len(data) == 0:
            raise DataError(
                f"the data source {type(data).__name__} is empty (0 records); point "
                f"data.name/data.path at data with records"
            )
        return data
    return RecordSource(data, keys=keys)
