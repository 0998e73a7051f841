"""The LM head as a loss can take it: the last hidden states and the head's weight, so that the next-token
statistics run over chunks of positions and the ``[tokens, vocab]`` float32 logits (and their gradient) never
exist whole.

A causal LM whose call names the keyword ``logits_chunk`` (:data:`LOGITS_CHUNK`) returns an
:class:`Unembedding` instead of its logits when the keyword is not None (functrain's built-in LMs do); the
loss then asks it for :func:`chunked_statistics` where :func:`chunk_positions` says so, else for its
:meth:`Unembedding.whole_logits`.

Chunks are ``[B, chunk, vocab]`` strided slices of the sequence (the batch axis, sharded over the mesh, stays whole):
a ``lax.scan`` over them, the head's matmul inside, each chunk rematerialised in the backward pass
(``jax.checkpoint``), so the forward keeps one chunk's logits at a time and the backward recomputes them. The
cost: the head's forward matmul once more (``2 * d_model * vocab`` FLOPs a token).

``train.logits_chunk``: ``auto`` (chunk when the whole logits would take more than :data:`AUTO_WHOLE_BYTES` per
device, in chunks of at most :data:`AUTO_CHUNK_BYTES`), a number of positions per chunk, or ``off`` (the model
returns its logits; no chunking).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal

import jax
import jax.numpy as jnp

# The model call's keyword asking for an Unembedding: the chunk setting (``auto`` or positions per chunk).
LOGITS_CHUNK = "logits_chunk"
# ``train.logits_chunk``: off, auto, or positions per chunk.
LogitsChunk = Literal["auto", "off"] | int
# auto: the whole float32 logits are chunked above this many bytes per device ...
AUTO_WHOLE_BYTES = 256 * 2**20
# ... into chunks of at most this many bytes per device (a power-of-two number of positions).
AUTO_CHUNK_BYTES = 128 * 2**20


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["hidden", "weight"], meta_fields=["chunk", "finish", "product"]
)
@dataclass(frozen=True)
class Unembedding:
    """The head of a causal LM, not yet applied: ``logits = finish(float32(hidden @ weight))``.

    ``hidden`` ``[B, T, D]`` in the model's compute dtype; ``weight`` ``[D, V]`` as stored (the parameter; cast to
    the compute dtype inside each chunk, so the chunks' gradients add up in the parameter's dtype, not in
    bfloat16); ``finish`` an element-wise function of the float32 logits (Gemma 2's soft-cap) or None; ``product``
    the model's ``lax.dot_general`` for the matmul (None: ``lax.dot_general``); ``chunk``
    the ``logits_chunk`` the model was called with (``auto`` or positions per chunk)."""

    hidden: Any
    weight: Any
    chunk: LogitsChunk
    finish: Callable[[Any], Any] | None = None
    product: Callable[..., Any] | None = None

    def whole_logits(self) -> jax.Array:
        """The whole float32 logits ``[B, T, V]`` (a method, not ``.logits``: a model's output's ``.logits``
        (:class:`functrain.core.model_output.ModelOutput`) are what the loss is handed, and that is this object)."""
        return head_logits(self.hidden, self.weight, self.finish, self.product)


def head_logits(
    hidden: Any, weight: Any, finish: Callable[[Any], Any] | None, product: Callable[..., Any] | None = None
) -> jax.Array:
    """``finish(float32(hidden @ weight))``: the logits of hidden states ``[..., D]``, the matmul in their dtype
    (by ``product``, a ``lax.dot_general``, when given: the model's, :mod:`functrain.models.matmul`)."""
    dimensions = (((jnp.ndim(hidden) - 1,), (0,)), ((), ()))
    logits = (product or jax.lax.dot_general)(hidden, jnp.asarray(weight, hidden.dtype), dimensions)
    logits = logits.astype(jnp.float32)
    return logits if finish is None else finish(logits)


def chunk_positions(head: Any) -> int | None:
    """The positions per chunk for an :class:`Unembedding`'s logits, or None for whole logits (they are small,
    the chunk holds the whole sequence, or ``head`` is logits already)."""
    if not isinstance(head, Unembedding):
        return None
    batch, length, _ = head.hidden.shape
    vocab = head.weight.shape[-1]
    if head.chunk == "auto":
        devices = max(jax.sharding.get_abstract_mesh().size, 1)  # the logits split over every mesh axis
        row_bytes = batch * vocab * 4 / devices  # one position of every row on a device
        if row_bytes * length <= AUTO_WHOLE_BYTES:
            return None
        chunk = 1 << max(int(AUTO_CHUNK_BYTES // row_bytes).bit_length() - 1, 0)
    else:
        chunk = int(head.chunk)
    return None if chunk >= length else chunk


def chunked_statistics(head: Unembedding, targets: Any, chunk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(label_logits, log_normalisers, max_logits)`` ``[B, T]`` float32 of ``targets`` ``[B, T]`` (valid ids),
    computed over chunks of ``chunk`` positions (:func:`chunk_positions`): the cross-entropy is
    ``log_normalisers - label_logits``, the log-prob its negative, a prediction right where
    ``label_logits >= max_logits``."""

    def statistics(logits: jax.Array, target_chunk: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
        label_logits = jnp.take_along_axis(logits, target_chunk[..., None], axis=-1)[..., 0]
        # The maximum only decides accuracy: no gradient flows through it.
        return label_logits, jax.nn.logsumexp(logits, axis=-1), jax.lax.stop_gradient(jnp.max(logits, axis=-1))

    label_logits, log_normalisers, max_logits = over_chunks(head, targets, chunk, statistics)
    return label_logits, log_normalisers, max_logits


def over_chunks(
    head: Unembedding, targets: Any, chunk: int, statistics: Callable[[jax.Array, Any], tuple[jax.Array, ...]]
) -> tuple[jax.Array, ...]:
    """``statistics(logits, targets)`` of each chunk of ``chunk`` positions (its float32 logits ``[B, chunk, V]``
    and targets ``[B, chunk]`` -> arrays ``[B, chunk]``), put together ``[B, T]``: the logits of one chunk exist at
    a time, and the backward recomputes them."""
    batch, length, width = head.hidden.shape
    count = -(-length // chunk)
    padding = count * chunk - length  # the last chunk is padded; its statistics are cut off below
    hidden = jnp.pad(head.hidden, ((0, 0), (0, padding), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, padding)))
    # Chunk k holds positions k, k + count, k + 2 * count, ...: strided, so that a sequence split over devices in
    # blocks (context parallelism) has its share of every chunk on every device, and none computes another's.
    hidden = hidden.reshape(batch, chunk, count, width).transpose(2, 0, 1, 3)
    targets = targets.reshape(batch, chunk, count).transpose(2, 0, 1)

    @jax.checkpoint  # the backward recomputes a chunk's logits instead of keeping every chunk's
    def one_chunk(hidden_chunk: Any, target_chunk: Any) -> tuple[jax.Array, ...]:
        return statistics(head_logits(hidden_chunk, head.weight, head.finish, head.product), target_chunk)

    traced = _traced.get()
    if traced is not None:
        traced.append(count)
    _, stats = jax.lax.scan(lambda _, xs: (None, one_chunk(*xs)), None, (hidden, targets))
    return tuple(value.transpose(1, 2, 0).reshape(batch, count * chunk)[:, :length] for value in stats)


def logits_array(logits: Any) -> Any:
    """The whole logits of a model's logits or :class:`Unembedding`."""
    return logits.whole_logits() if isinstance(logits, Unembedding) else logits


# The chunk counts of the loops traced now (:func:`chunk_loops_traced`), or None: not recorded.
_traced: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("traced_logits_chunks", default=None)


@contextlib.contextmanager
def chunk_loops_traced() -> Iterator[list[int]]:
    """A list that gathers the chunk count of every chunk loop traced inside (how a traced program chunks its
    cross-entropy, which nothing in the traced program itself says)."""
    traced: list[int] = []
    token = _traced.set(traced)
    try:
        yield traced
    finally:
        _traced.reset(token)
