"""Batch-invariant products and attention (``model.batch_invariant``): a row's result does not depend on how many
rows are computed with it, nor on whether a token is decoded against a KV cache or run with its whole sequence.

Why it is needed: a compiler picks a product's kernel (and with it the order its sums round in) by the product's
shape. A decoded token multiplies ``[B, 1, d]`` rows, the training forward ``[B, T, d]``: XLA:CPU took different
kernels for a few rows than for many (last-bit differences from 3 rows up), a GPU's GEMMs split their sums by shape
(``rollout/logprob_gap`` 9.5e-6 in float32, 2e-3 with TF32 products, bench/README.md). So sampler and trainer
disagreed, by a little, on the log-probs RL divides by each other.

How: every product a row's result goes through is computed in tiles of one fixed shape, whatever the number of rows
(what torchtitan's and Thinking Machines' batch-invariant kernels do with fixed tiles, without split reductions):

- a dense layer's ``[M, K] @ [K, N]`` runs as a loop over ``ceil(M / DENSE_ROWS)`` products ``[DENSE_ROWS, K] @
  [K, N]`` (the rows padded with zeros): each takes the same kernel, and a row's sums do not depend on the other rows
  of its tile. A loop, not one batched product: XLA merges a batched product with broadcast weights back into one
  product of all the rows, and fuses the rows' producers into it differently by size;
- attention runs as a loop over tiles of ``ATTENTION_ROWS`` query rows (positions x grouped heads), each over the
  keys in blocks of ``KEY_BLOCK`` positions, in order (an online softmax: running maximum, running weighted values),
  with scores ``[ATTENTION_ROWS, D] @ [D, KEY_BLOCK]`` and weighted values ``[ATTENTION_ROWS, KEY_BLOCK] @
  [KEY_BLOCK, D + 1]`` (a column of ones gives the softmax's sum in the same product). Blocks are aligned on key
  positions, so a decoded token, whose cache runs further than the sequence, sees the same blocks; a wholly masked
  block changes nothing (its weights are exact zeros, the running maximum stays).

Norms and the logits' log-softmax reduce each row over its own features with nothing of other rows; XLA:CPU's
reductions keep one order per row length (the tests check them with the rest). On CPU the programs are compiled with
YNNPACK on each product alone (:data:`functrain.tasks.sampling.INVARIANT_OPTIONS`). Only the forward is
batch-invariant: the backward of a product is the plain one (gradients need no bitwise twin).

On a GPU or TPU every product has one shape too, and XLA's kernel for one shape sums in one order in two programs
where its choice is deterministic (a GPU's ``train.deterministic``); that, and the loops' cost there, are for a device
to confirm: a fixed-tile Pallas kernel would run a product's tiles in one launch.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array

DENSE_ROWS = 16  # rows of a dense product's tile
ATTENTION_ROWS = 8  # query rows (positions x grouped heads) of an attention tile: few, a decoded token has G rows
KEY_BLOCK = 32  # key positions of an attention block

_BATCH_INVARIANT: ContextVar[bool] = ContextVar("batch_invariant", default=False)


@contextlib.contextmanager
def batch_invariance(enabled: bool = True) -> Iterator[None]:
    """Within the block (while a model is traced), the built-in products and attention are batch-invariant, or not."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def batch_invariant() -> bool:
    """Whether the model being traced asked for batch-invariant products (:func:`batch_invariance`)."""
    return _BATCH_INVARIANT.get()


def traced_as_configured(call: Callable) -> Callable:
    """A built-in model's ``__call__`` traced batch-invariant when its ``config.batch_invariant`` says so (under
    ``nn.compact``: the layers it calls are traced inside)."""

    @functools.wraps(call)
    def traced(module: Any, *args: Any, **kwargs: Any) -> Any:
        with batch_invariance(module.config.batch_invariant):
            return call(module, *args, **kwargs)

    return traced


def _tiled_product(lhs: Array, rhs: Array, precision: Any, preferred: Any) -> Array:
    """``[M, K] @ [K, N]`` as products ``[DENSE_ROWS, K] @ [K, N]`` of one shape, a loop over the tiles: one product
    in the loop's body, whose operands nothing is fused into (XLA:CPU fused an activation into a product of many rows
    and computed it otherwise than for few: GPT's tanh GELU, 2.4e-7 apart)."""
    tiles = _tiles_first(lhs, 0, DENSE_ROWS)
    out = lax.map(lambda tile: lax.dot(tile, rhs, precision=precision, preferred_element_type=preferred), tiles)
    return out.reshape(-1, rhs.shape[1])[: lhs.shape[0]]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def invariant_dense(lhs: Array, rhs: Array, contracted: int, precision: Any = None, preferred: Any = None) -> Array:
    """A dense layer's product (``lhs``'s last ``contracted`` axes against ``rhs``'s first ones), each row's result
    independent of the other rows; its gradient is the plain product's."""
    inner = math.prod(rhs.shape[:contracted])
    flat = _tiled_product(lhs.reshape(-1, inner), rhs.reshape(inner, -1), precision, preferred)
    return flat.reshape(*lhs.shape[: lhs.ndim - contracted], *rhs.shape[contracted:])


def _dense_forward(lhs, rhs, contracted, precision, preferred):
    return invariant_dense(lhs, rhs, contracted, precision, preferred), (lhs, rhs)


def _dense_backward(contracted, precision, preferred, residuals, grad):
    lhs, rhs = residuals
    dims = (tuple(range(lhs.ndim - contracted, lhs.ndim)), tuple(range(contracted)))
    _, pullback = jax.vjp(lambda a, b: lax.dot_general(a, b, (dims, ((), ())), precision, preferred), lhs, rhs)
    return pullback(grad)


invariant_dense.defvjp(_dense_forward, _dense_backward)


def invariant_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    mask: Array,
    softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """Softmax attention of ``[B, T, H, D]`` queries over ``[B, S, KV, D]`` keys and values where ``mask``
    (``[B or 1, 1, T, S]`` bool) is True, as :func:`functrain.models.masked_attention.masked_attention` takes them,
    with each query row's result independent of ``B``, ``T`` and of keys it does not see (see the module)."""
    batch, length, heads, head_dim = query.shape
    kv_heads, keys = key.shape[2], key.shape[1]
    group = heads // kv_heads
    # Rows: each (position, grouped head) of a key/value head, in tiles of ATTENTION_ROWS (first axis: a loop's).
    rows = query.reshape(batch, length, kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    rows = _tiles_first(rows.reshape(batch, kv_heads, length * group, head_dim), 2, ATTENTION_ROWS)
    seen = jnp.broadcast_to(mask[:, 0, :, None, :], (mask.shape[0], length, group, keys))
    seen = _tiles_first(seen.reshape(mask.shape[0], 1, length * group, keys), 2, ATTENTION_ROWS)
    starts = jnp.full(rows.shape[:-1], -jnp.inf, jnp.float32)  # the running maxima
    if sinks is not None:  # a sink is one more key of weight exp(sink), attending to nothing: it starts the sums
        per_row = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv_heads, 1, group), (kv_heads, length, group))
        starts = jnp.broadcast_to(_tiles_first(per_row.reshape(1, kv_heads, -1), 2, ATTENTION_ROWS), starts.shape)
    ones = jnp.ones((*value.shape[:-1], 1), value.dtype)  # the softmax's sum, in the weighted values' product
    key_blocks = _tiles_first(key.transpose(0, 2, 1, 3), 2, KEY_BLOCK)  # [blocks, B, KV, KEY_BLOCK, D]
    value_blocks = _tiles_first(jnp.concatenate([value, ones], -1).transpose(0, 2, 1, 3), 2, KEY_BLOCK)

    def one_tile(tile: tuple[Array, Array, Array]) -> Array:
        tile_rows, tile_seen, tile_start = tile
        visible_blocks = _tiles_first(tile_seen, 3, KEY_BLOCK)  # [blocks, B or 1, 1, ATTENTION_ROWS, KEY_BLOCK]
        total = jnp.zeros((batch, kv_heads, ATTENTION_ROWS, head_dim + 1), jnp.float32)
        if sinks is not None:
            total = total.at[..., -1].set(1.0)
        blocks = (key_blocks, value_blocks, visible_blocks)
        (_, total), _ = lax.scan(functools.partial(_one_block, tile_rows, scale, softcap), (tile_start, total), blocks)
        sums = total[..., -1:]
        return total[..., :-1] / jnp.where(sums > 0, sums, 1.0)

    out = lax.map(one_tile, (rows, seen, starts))  # [tiles, B, KV, ATTENTION_ROWS, D]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, kv_heads, -1, head_dim)[:, :, : length * group]
    out = out.reshape(batch, kv_heads, length, group, head_dim).transpose(0, 2, 1, 3, 4)
    return out.reshape(batch, length, heads, head_dim).astype(query.dtype)


def _tiles_first(array: Array, axis: int, tile: int) -> Array:
    """``array`` with ``axis`` padded (zeros, False) to whole tiles of ``tile`` and the tiles' index moved first."""
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, -array.shape[axis] % tile)
    array = jnp.pad(array, pad)
    return jnp.moveaxis(array.reshape(*array.shape[:axis], -1, tile, *array.shape[axis + 1 :]), axis, 0)


def _one_block(
    rows: Array, scale: float, softcap: float | None, carry: tuple[Array, Array], block: tuple[Array, Array, Array]
) -> tuple[tuple[Array, Array], None]:
    """One block of keys into a tile's online softmax: ``carry`` (running maxima, running weighted values and sum)."""
    running_max, total = carry
    keys, values, visible = block
    batch_dims = ((0, 1), (0, 1))
    scores = lax.dot_general(rows, keys, (((3,), (3,)), batch_dims), preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(visible, scores, -jnp.inf)
    new_max = jnp.maximum(running_max, scores.max(-1))
    kept = jnp.isfinite(new_max)  # a row that has seen nothing yet keeps zeros
    shift = jnp.where(kept, new_max, 0.0)
    rescale = jnp.where(kept, jnp.exp(running_max - shift), 1.0)
    weights = jnp.where(visible, jnp.exp(scores - shift[..., None]), 0.0).astype(values.dtype)
    weighted = lax.dot_general(weights, values, (((3,), (2,)), batch_dims), preferred_element_type=jnp.float32)
    return (new_max, total * rescale[..., None] + weighted), None
