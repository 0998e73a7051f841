"""Data: a batch is a pure function of ``(seed, position)``.

*Position* is the number of samples consumed from the infinite sample stream. Stream index ``g`` is in epoch
``g // N`` and maps to a record through a permutation of ``[0, N)`` keyed by ``(seed, epoch)`` (grain's
O(1)-memory index shuffle). Resuming is arithmetic, never a replay; the global batch sequence is the same for
any number of processes or devices and continues at the exact sample when the batch size changes.

Public API::

    IndexSampler(num_records, global_batch_size, seed, shuffle=True, last_batch="drop" | "pad")
        .order(global_index) -> int                  # record at stream index g
        .record_indices(positions: ndarray) -> ndarray  # vectorised order
        .batch_at(position) -> (record_indices [B], weights [B] float32, next_position)
        .batch_positions(position) -> (stream_indices [B], weights [B], next_position)
        .batch_rows(position, first, stop) -> (stream_indices, record_indices, weights, next_position)  # a slice
        .batch_indices(step) -> record_indices [B]   # research code: fixed batch size from position 0
        .position_of_step(step) -> int
        .steps_per_epoch, .epoch_of(position), .batch_start(position), .steps_until_epoch(position, epoch)

    ArraySource({"x": x, "y": y})                    # arrays or memmaps; batched fancy-index gather
    TokenStore.open(path)                            # a store written by `functrain tokenize` (memory maps)
        .read(starts, length) -> int32 [len(starts), length]; .doc_starts; .num_tokens; .vocab_size
    StoreWriter(out, vocab_size, tokenizer_info)     # context manager: .add(tokens, lengths); atomic rename
    TokenWindows(store, seq_len, packing=False, first=0, stop=None)   # data.name: tokens; records are
        seq_len + 1 token windows ("tokens"), plus "segment_ids" and "positions" when packing
    token_splits(path, seq_len, packing, eval_fraction, vocab_size) -> (train TokenWindows, eval or None)
    RecordSource(dataset, keys=None)                 # torch / HF / grain map-style dataset adapter
    as_source(data, keys=None) -> Source

    transform(record: dict, rng: np.random.Generator) -> dict   # rng = sample_rng(seed, stream_index)

    BatchLoader(source, sampler, process_index=0, process_count=1, transform=None, prefetch=2)
        .host_batch(position) -> (batch [B/P, ...] with "weight", next_position)
        .iter_from(position, steps_per_call=K, num_steps=None, place=None)
            -> closeable iterator of (host_batch [K, B/P, ...], start_position, end_position)

    to_global(host_batch, sharding_or_mesh, batch_axis=1) -> pytree of jax.Array
    batch_sharding(mesh, batch_axis=1, mesh_axes=None) -> NamedSharding

    check_resume(meta, num_records, seed, ignore_skip, skip_samples=None)   # raises DataError on mismatch
    resume_position(meta, ignore_skip, skip_samples) -> position
    data_meta(sampler, position, previous=None) -> dict for the checkpoint meta

    Mixture([(source, weight), ...], block_size=1024, names=None)   # a Source: sources drawn by weight
    MixtureSampler(mixture, global_batch_size, seed, shuffle=True)  # its order (IndexSampler's interface)
        .sources_and_records(positions) -> (source numbers, record indices in each source)
        .consumed(position) -> items each source served before position
    ConcatSource(sources, names=None)                # sources one after the other in one index space

    Stream(iterable_or_factory, keys=None)           # HF IterableDataset, f(start) / f() -> iterator, iterable
    StreamOrder(global_batch_size, seed), StreamLoader(stream, order, process_index, process_count, ...)

    order_for(data, global_batch_size, seed, shuffle, last_batch) -> IndexSampler | MixtureSampler | StreamOrder
    loader_for(data, order, process_index, process_count, prefetch, check) -> BatchLoader | StreamLoader
    as_data(data) -> Source | Stream                 # what fit(train_data=...) does with its argument
    order.extra_meta(position) -> dict               # the order's checkpoint fields (schedule, stream state)
    order.restore(meta, position)                    # continue what a checkpoint recorded

Mixtures and data schedules: :mod:`functrain.data.mixture`; streaming guarantees: :mod:`functrain.data.stream`.

Batches never straddle epochs: ``last_batch="drop"`` skips an epoch's tail shorter than a batch (the position
jumps to the next epoch); ``"pad"`` fills it from the start of that epoch's order with weight 0.
Bad input raises :class:`functrain.errors.DataError` with one line naming the problem and the fix.
"""

from functrain.data.global_array import batch_sharding, to_global
from functrain.data.kinds import as_data, loader_for, order_for
from functrain.data.loader import BatchLoader
from functrain.data.mixture import ConcatSource, Mixture, MixtureSampler
from functrain.data.prefetch import BackgroundIterator
from functrain.data.resume import check_resume, data_meta, resume_position
from functrain.data.sampler import IndexSampler
from functrain.data.sources import ArraySource, RecordSource, Source, as_source, stack_records
from functrain.data.stream import Stream, StreamLoader, StreamOrder
from functrain.data.token_store import StoreWriter, TokenStore
from functrain.data.token_windows import TokenWindows, token_splits
from functrain.data.transforms import Transform, apply_transform, sample_rng

__all__ = [
    "ArraySource",
    "BackgroundIterator",
    "BatchLoader",
    "ConcatSource",
    "IndexSampler",
    "Mixture",
    "MixtureSampler",
    "RecordSource",
    "Source",
    "StoreWriter",
    "Stream",
    "StreamLoader",
    "StreamOrder",
    "TokenStore",
    "TokenWindows",
    "Transform",
    "apply_transform",
    "as_data",
    "as_source",
    "batch_sharding",
    "check_resume",
    "data_meta",
    "loader_for",
    "order_for",
    "resume_position",
    "sample_rng",
    "stack_records",
    "to_global",
    "token_splits",
]
