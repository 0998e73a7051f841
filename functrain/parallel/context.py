"""Context parallelism: a sequence split over the ``context`` mesh axis, in load-balanced order.

Under a mesh whose ``context`` axis has ``C > 1`` devices, a model that supports it (its family declares
``context_parallel``) runs its layers on the sequence reordered by :func:`load_balanced_order`: the sequence is
cut into ``2C`` chunks and device ``d`` holds chunks ``d`` and ``2C - 1 - d``, one from the start and one from
the end, so that every device has the same share of causal attention work (the first chunk's queries see few
keys, the last chunk's see almost all). The reorder happens at the edges of the model: its token ids, segment
ids and positions are permuted on entry (positions are the true ones, so RoPE and learned position tables see
the original positions), and its final hidden states are put back in the original order before the head, so
the logits, the loss, its targets and weights, and every task's log-probabilities keep the order of the batch.

Attention (:mod:`functrain.models.context_attention`) is the only layer that mixes tokens: it all-gathers the
keys and values over ``context`` and masks with each query's true position.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from functrain.errors import ConfigError
from functrain.parallel.sharding import constrain_batch

CONTEXT_AXIS = "context"


def context_ways() -> int:
    """The size of the ``context`` axis of the mesh in context (``jax.set_mesh``); 1 without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or CONTEXT_AXIS not in mesh.axis_names:
        return 1
    return int(mesh.shape[CONTEXT_AXIS])


@functools.lru_cache(maxsize=16)
def load_balanced_order(length: int, ways: int) -> np.ndarray:
    """``[length]`` int32: the original index of each token in load-balanced order over ``ways`` devices.

    Device ``d`` holds positions ``[d * length / ways, (d + 1) * length / ways)`` of the reordered sequence:
    chunk ``d`` then chunk ``2 * ways - 1 - d`` of the ``2 * ways`` chunks of the original one. ``length`` must
    divide by ``2 * ways`` (the config checks it)."""
    chunk = length // (2 * ways)
    chunks = [(d, 2 * ways - 1 - d) for d in range(ways)]
    order = np.concatenate([np.arange(c * chunk, (c + 1) * chunk, dtype=np.int32) for pair in chunks for c in pair])
    order.setflags(write=False)  # cached: shared by every caller
    return order


def to_context_order(x: jax.Array, ways: int) -> jax.Array:
    """``x [B, T, ...]`` with its tokens in load-balanced order (``x`` itself when ``ways`` is 1)."""
    return x if ways == 1 else jnp.take(x, load_balanced_order(x.shape[1], ways), axis=1)


def from_context_order(x: jax.Array, ways: int) -> jax.Array:
    """The inverse of :func:`to_context_order`: ``x [B, T, ...]`` back in the original token order, its sequence
    still split over ``context`` (the gather would otherwise leave it whole on every device, and the LM head
    after it would run ``ways`` times over)."""
    if ways == 1:
        return x
    return constrain_batch(jnp.take(x, np.argsort(load_balanced_order(x.shape[1], ways)), axis=1))


def context_inputs(
    tokens: jax.Array, segment_ids: jax.Array | None, positions: jax.Array | None, decoding: bool = False
) -> tuple[jax.Array, jax.Array | None, jax.Array | None, int]:
    """A model's ``[B, T]`` inputs in load-balanced order, and the ways the sequence is split (1 when
    ``decoding`` with a KV cache: new tokens are not split).

    With a ``context`` axis larger than 1 the positions are made explicit (``0..T-1`` when none are given)
    before the reorder, so the layers see each token's true position; without one everything is unchanged."""
    ways = 1 if decoding else context_ways()
    if ways == 1:
        return tokens, segment_ids, positions, 1
    if tokens.shape[1] % (2 * ways):  # data whose length is not data.seq_len (the config checks that one)
        raise ConfigError(
            f"a sequence of {tokens.shape[1]} tokens does not split into 2 x mesh.context={ways} equal chunks; "
            f"make the data's sequences a multiple of {2 * ways} tokens long"
        )
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    permute = functools.partial(to_context_order, ways=ways)
    return permute(tokens), None if segment_ids is None else permute(segment_ids), permute(positions), ways
