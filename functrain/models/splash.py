"""Splash attention: the Pallas flash-attention kernel for TPU (``model.attention=splash``).

``jax.experimental.pallas.ops.tpu.splash_attention`` (the kernel MaxText trains with) computes causal softmax
attention block by block and never holds a ``[T, T]`` score matrix, in the forward or the backward pass. It
takes what :func:`functrain.models.attention.attend` offers: causal, segment ids (packed documents), a sliding
window (a ``LocalMask``), grouped-query heads (each query head reads its key/value head; nothing is repeated),
Gemma 2's logit soft-cap and GPT-OSS's attention sinks (one logit per query head).

- The kernel works on one sequence ``[heads, T, head_dim]``: the batch is ``vmap``-ed, and inside a sharded
  ``jit`` (a mesh in context, ``jax.set_mesh``) the call is wrapped in ``shard_map`` over the batch axes
  (``data``, ``fsdp``) and, where the head counts divide it, ``tensor`` over heads, as MaxText does: a Pallas
  call cannot be partitioned by XLA.
- Its blocks are multiples of 128 tokens: the sequence is padded at the end to a multiple of 128 (and of the
  block), which causality makes invisible to the real tokens; the padded rows are cut off again.
- It takes bfloat16 or float32 and head widths up to 256 (:func:`splash_problem`); float16 does not compile for
  TPU (Mosaic) and wider heads overflow the kernel's VMEM at 512-token blocks.
- Context parallelism (:mod:`functrain.models.context_attention`) runs :func:`ordered_kernel`: each device's
  queries, in load-balanced order, against the whole gathered keys, with the causal mask computed from the
  queries' true positions and split over the devices with them (:func:`kernel_specs`).
- :func:`interpreted` runs it through the Pallas interpreter on any platform, for tests on CPU.
"""

import contextlib
import functools
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from functrain.data.global_array import BATCH_AXES
from functrain.errors import ConfigError
from functrain.parallel.context import load_balanced_order

Array = jax.Array
SPLASH_DTYPES = (jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256
LANES = 128  # the kernel's key blocks are multiples of the TPU's 128 lanes
BLOCK_CHOICES = (512, 256, 128)  # MaxText's default block is 512 tokens
HEAD_AXIS = "tensor"

_INTERPRETED: ContextVar[bool] = ContextVar("splash_interpreted", default=False)


@contextlib.contextmanager
def interpreted() -> Iterator[None]:
    """Within the block splash attention is available on every platform and runs in the Pallas interpreter
    (``interpret=True``): how the tests check it on CPU against the XLA kernel."""
    token = _INTERPRETED.set(True)
    try:
        yield
    finally:
        _INTERPRETED.reset(token)


def is_interpreted() -> bool:
    """True inside :func:`interpreted`."""
    return _INTERPRETED.get()


def splash_problem(dtype: Any, head_dim: int) -> str | None:
    """Why splash cannot take ``dtype`` compute and ``head_dim``-wide heads, or None when it can."""
    if not any(jnp.dtype(dtype) == jnp.dtype(d) for d in SPLASH_DTYPES):
        return f"train.compute_dtype bfloat16 or float32 (got {jnp.dtype(dtype).name})"
    if head_dim > MAX_HEAD_DIM:
        return f"a head width up to {MAX_HEAD_DIM} (got {head_dim})"
    return None


def padded_length(length: int) -> tuple[int, int]:
    """The sequence length the kernel runs at (a multiple of 128 and of the block) and its block."""
    padded = -(-length // LANES) * LANES
    block = next(size for size in BLOCK_CHOICES if padded % size == 0)
    return padded, block


def _kernel(
    heads: int,
    length: int,
    block: int,
    window: int | None,
    softcap: float | None,
    query_order: np.ndarray | None = None,
    query_shards: int = 1,
) -> Any:
    # Imported on use: Pallas adds a third of a second to every process that imports the models.
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    if query_order is not None:
        mask = _ordered_mask_class()(length, query_order, window)
    elif window is None:
        mask = splash.CausalMask((length, length))
    else:
        mask = splash.LocalMask((length, length), (window - 1, 0), offset=0)
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return splash.make_splash_mha(
        splash.MultiHeadMask([mask] * heads),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=query_shards,
        attn_logits_soft_cap=softcap,
        interpret=is_interpreted(),
    )


@functools.cache
def _ordered_mask_class() -> type:
    # Made on first use: the mask module comes with Pallas, which every process importing the models need not load.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    class OrderedCausalMask(masks._ComputableMask):
        """The causal (or sliding-window) mask of queries at the true positions ``query_order`` over keys in their
        original order: the load-balanced order of context parallelism (MaxText's ``LoadBalancedCausalMask``)."""

        def __init__(self, length: int, query_order: np.ndarray, window: int | None) -> None:
            self.window = window

            def visible(query: Any, key: Any) -> Any:  # numpy blocks while processing the mask, jnp in the kernel
                causal = query >= key
                return causal if window is None else causal & (query - key < window)

            super().__init__((length, length), visible)
            self.q_sequence = query_order  # the kernel reads it for the blocks it masks element by element

        def __eq__(self, other: object) -> bool:
            return (
                isinstance(other, OrderedCausalMask)
                and (self.shape, self.window) == (other.shape, other.window)
                and np.array_equal(self.q_sequence, other.q_sequence)
            )

        def __hash__(self) -> int:
            return hash((self.shape, self.window, self.q_sequence.tobytes()))

    return OrderedCausalMask


def ordered_kernel(heads: int, length: int, shards: int, window: int | None, softcap: float | None) -> Any:
    """The splash kernel over ``heads`` heads of a ``length``-token sequence whose queries are split over
    ``shards`` devices in load-balanced order (:func:`functrain.parallel.context.load_balanced_order`) and whose
    keys are whole, in their original order. Pass it to ``shard_map`` with :func:`kernel_specs`, so that each
    device reads its queries' part of the mask. Its processed mask is cached by the mask's hash (a 128k-token
    mask takes a minute of CPU to process): the layers and the backward pass share it."""
    if (length // shards) % LANES:  # data whose length is not data.seq_len (the config checks that one)
        raise ConfigError(
            f"a sequence of {length} tokens over mesh.context={shards} leaves {length // shards} tokens a device, "
            f"which splash attention's {LANES}-token blocks do not divide; make it a multiple of {LANES * shards} "
            f"or set model.attention=xla"
        )
    block = next(size for size in BLOCK_CHOICES if (length // shards) % size == 0)
    return _kernel(heads, length, block, window, softcap, load_balanced_order(length, shards), shards)


def kernel_specs(kernel: Any, sequence_axis: str) -> Any:
    """The ``shard_map`` specs of :func:`ordered_kernel`'s kernel: its mask split over ``sequence_axis``."""
    mesh = jax.sharding.get_abstract_mesh()
    return kernel.manual_sharding_spec(NamedSharding(mesh, PartitionSpec(None, sequence_axis)))


def run_kernel(
    kernel: Any,
    query: Array,
    key: Array,
    value: Array,
    segment_ids: tuple[Array, Array] | None,
    sinks: Array | None,
) -> Array:
    """``kernel`` on ``[B, T, H, D]`` queries and ``[B, S, KV, D]`` keys and values (the segment ids ``[B, T]`` of
    the queries and ``[B, S]`` of the keys, or None) and the heads' ``[H]`` sinks."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731 -- [B, H, T, D], the kernel's layout
    segments = None if segment_ids is None else SegmentIds(q=segment_ids[0], kv=segment_ids[1])
    run = lambda q, k, v, s: kernel(q, k, v, segment_ids=s, sinks=sinks)  # noqa: E731 -- the sinks are per head
    out = jax.vmap(run)(heads_first(query), heads_first(key), heads_first(value), segments)
    return heads_first(out)


def _local_attention(
    query: Array,
    key: Array,
    value: Array,
    segment_ids: Array | None,
    sinks: Array | None,
    *,
    block: int,
    window: int | None,
    softcap: float | None,
) -> Array:
    """Splash on this device's ``[B, T, H, D]`` shard (T already padded) and its heads' ``[H]`` sinks."""
    kernel = _kernel(query.shape[2], query.shape[1], block, window, softcap)
    return run_kernel(kernel, query, key, value, None if segment_ids is None else (segment_ids, segment_ids), sinks)


def shard_specs(
    batch: int, heads: int, kv_heads: int, sequence_axis: str | None = None
) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec] | None:
    """The shard_map specs of ``[B, T, H, D]`` arrays, ``[B, T]`` segment ids and ``[H]`` sinks under the mesh in
    context, or None without one; the sequence split over ``sequence_axis`` when given. Axes that do not divide
    their dimension leave it whole (each device then computes it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch_axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    if batch % math.prod(mesh.shape[axis] for axis in batch_axes):
        batch_axes = ()
    head_ways = mesh.shape.get(HEAD_AXIS, 1)
    head_axis = HEAD_AXIS if head_ways > 1 and heads % head_ways == 0 and kv_heads % head_ways == 0 else None
    batch_spec = batch_axes or None
    return (
        PartitionSpec(batch_spec, sequence_axis, head_axis, None),
        PartitionSpec(batch_spec, sequence_axis),
        PartitionSpec(head_axis),
    )


def splash_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    segment_ids: Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """Causal attention through the splash kernel; arguments and result as
    :func:`functrain.models.attention.attend` (``[B, T, H, D]`` queries, ``[B, T, KV, D]`` keys and values)."""
    batch, length, heads, _ = query.shape
    padded, block = padded_length(length)
    # The kernel has no scale argument: scaling the queries scales the scores (before any soft-cap, as HF does).
    # The sinks join the scaled scores as they are (HF adds them after scaling).
    query = query * jnp.asarray(scale, query.dtype)
    if padded != length:
        # Padding goes after the real tokens: causality keeps it out of their softmax.
        pad = lambda x: jnp.pad(x, ((0, 0), (0, padded - length), (0, 0), (0, 0)))  # noqa: E731
        query, key, value = pad(query), pad(key), pad(value)
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, padded - length)), constant_values=-1)

    def attention(q: Array, k: Array, v: Array, s: Array | None, h: Array | None) -> Array:
        return _local_attention(q, k, v, s, h, block=block, window=window, softcap=softcap)

    specs = shard_specs(batch, heads, key.shape[2])
    if specs is not None:
        qkv_spec, segment_spec, sinks_spec = specs
        in_specs = (qkv_spec, qkv_spec, qkv_spec, segment_spec, sinks_spec)  # an absent (None) input has no leaves
        attention = jax.shard_map(attention, in_specs=in_specs, out_specs=qkv_spec, check_vma=False)
    return attention(query, key, value, segment_ids, sinks)[:, :length]
