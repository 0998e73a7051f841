"""Which order and loader a source gets: random-access sources an :class:`IndexSampler` and a
:class:`BatchLoader`, a :class:`Mixture` its :class:`MixtureSampler`, a stream a :class:`StreamOrder` and a
:class:`StreamLoader`. The loop (and research code) asks here, so every kind of data takes one code path.

Every order answers ``global_batch_size``, ``seed``, ``num_records`` (None for a stream), ``batch_start``,
``epoch_of``, ``steps_per_epoch``, ``extra_meta(position)`` (its checkpoint fields beyond the position) and
``restore(meta, position)`` (continue what a checkpoint recorded); every loader ``host_batch`` and ``iter_from``.
"""

from __future__ import annotations

from typing import Any

from functrain.data.loader import BatchLoader
from functrain.data.mixture import Mixture, MixtureSampler
from functrain.data.sampler import IndexSampler, LastBatch
from functrain.data.sources import as_source
from functrain.data.stream import Stream, StreamLoader, StreamOrder, is_stream
from functrain.data.transforms import Transform
from functrain.data.validate import BatchCheck
from functrain.errors import DataError

Order = IndexSampler | MixtureSampler | StreamOrder
_ORDER_MISMATCH = "a stream is read in a StreamOrder, other data in a sampler; build the order with order_for(source)"


def order_for(
    source: Any, global_batch_size: int, seed: int, shuffle: bool = True, last_batch: LastBatch = "drop"
) -> Order:
    """The global order of ``source`` (a Source, a :class:`Mixture` or a :class:`Stream`)."""
    if isinstance(source, Stream):
        return StreamOrder(global_batch_size, seed)
    if isinstance(source, Mixture):
        return MixtureSampler(source, global_batch_size, seed, shuffle=shuffle)
    return IndexSampler(len(source), global_batch_size, seed, shuffle=shuffle, last_batch=last_batch)


def loader_for(
    source: Any,
    order: Order,
    process_index: int = 0,
    process_count: int = 1,
    prefetch: int = 2,
    check: BatchCheck | None = None,
    transform: Transform | None = None,
) -> BatchLoader | StreamLoader:
    """This process's loader of ``source`` in ``order`` (``transform``: per record, map-style sources only)."""
    if isinstance(source, Stream):
        if transform is not None:
            raise DataError(
                "data.transform applies to map-style data (arrays, an HF or Grain dataset), and this "
                "data is a stream; transform the records in the stream itself or remove data.transform"
            )
        if not isinstance(order, StreamOrder):
            raise DataError(_ORDER_MISMATCH)
        return StreamLoader(source, order, process_index, process_count, prefetch=prefetch, check=check)
    if isinstance(order, StreamOrder):
        raise DataError(_ORDER_MISMATCH)
    return BatchLoader(source, order, process_index, process_count, prefetch=prefetch, check=check, transform=transform)


def as_data(data: Any, keys: tuple[str, ...] | None = None) -> Any:
    """Wrap ``data`` for training: a stream (an iterable or function that is not map-style, see
    :func:`~functrain.data.stream.is_stream`) as a :class:`Stream`, anything else by
    :func:`~functrain.data.sources.as_source`."""
    if isinstance(data, Stream):
        return data
    if is_stream(data):
        return Stream(data, keys=keys)
    return as_source(data, keys=keys)
