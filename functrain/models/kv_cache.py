"""A key/value cache for autoregressive decoding, kept in Flax's ``"cache"`` collection.

Decoding is on when a model is applied with ``mutable=["cache"]`` and its params frozen (training and
``init`` never are, so the models' training path is unchanged). ``functrain.text.decode`` first takes the
cache's shapes from one apply on a ``[batch, cache_len]`` input, fills them with zeros, then feeds the prompt
and one token at a time: each attention layer writes its new keys/values at their positions and attends
over the whole cache with a mask, so a new token costs one position, not the whole sequence again.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.paged_cache import paged, paged_extend, paged_positions

Array = jax.Array


def decoding(module: nn.Module) -> bool:
    """True when ``module`` is applied to decode with a cache (``mutable=["cache"]``, params frozen)."""
    return module.is_mutable_collection("cache") and not module.is_mutable_collection("params")


def next_positions(module: nn.Module, length: int) -> Array:
    """The positions of ``length`` new tokens: ``0..length-1``, or after those already cached when decoding
    (the module keeps its own count, which advances by ``length``); ``[B, length]`` against a paged cache, each
    row after its own count (:mod:`functrain.models.paged_cache`)."""
    positions = jnp.arange(length, dtype=jnp.int32)
    if not decoding(module):
        return positions
    if paged(module):
        return paged_positions(module, length)
    primed = module.has_variable("cache", "cache_index")
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not primed:  # the shape-taking apply: the cache starts empty
        return positions
    start = index.value
    index.value = start + length
    return start + positions


def extend_cache(module: nn.Module, key: Array, value: Array, positions: Array) -> tuple[Array, Array]:
    """Keys and values ``[B, T, KV, D]`` of the new tokens at ``positions`` -> those of the whole cache
    ``[B, S, KV, D]`` (the new ones written in); unchanged when not decoding. The cache holds them as
    ``[B, KV, D, S]``, the order XLA:CPU's attention dots read them in: stored as ``[B, S, KV, D]``, both whole
    caches were copied into it for every decoded token (bench_grpo's decoder: 7.1 -> 5.2 ms). Against a paged cache
    ``positions`` are ``[B, T]`` and each row's keys and values are gathered from its pages."""
    if not decoding(module):
        return key, value
    if paged(module):
        return paged_extend(module, key, value, positions)
    stored = lambda array: jnp.transpose(array, (0, 2, 3, 1))  # noqa: E731
    read = lambda array: jnp.transpose(array, (0, 3, 1, 2))  # noqa: E731
    return (
        read(cached(module, "cached_key", stored(key), positions, axis=3)),
        read(cached(module, "cached_value", stored(value), positions, axis=3)),
    )


def cached(module: nn.Module, name: str, new: Array, positions: Array, axis: int = 1) -> Array:
    """One cached array (the cache variable ``name``, positions on ``axis``) with the new tokens' (``T`` on
    ``axis``) written at ``positions``; ``new`` itself when not decoding or while taking the cache's shapes."""
    if not decoding(module):
        return new
    primed = module.has_variable("cache", name)
    variable = module.variable("cache", name, jnp.zeros, new.shape, new.dtype)
    if not primed:
        return new
    start = tuple(positions[0] if dim == axis else 0 for dim in range(new.ndim))
    variable.value = jax.lax.dynamic_update_slice(variable.value, new.astype(variable.value.dtype), start)
    return variable.value


def causal_mask(positions: Array, kv_length: int, window: int | None = None, chunk: int | None = None) -> Array:
    """``[T, S]`` (``[B, T, S]`` for a paged cache's ``[B, T]`` positions): query at ``positions[t]`` sees keys at
    positions ``<= positions[t]`` (a lower triangle when the queries are the whole sequence; later cache slots,
    still empty, are masked when decoding), with a
    ``window`` only those ``> positions[t] - window`` (HF's sliding-window overlay), and with a ``chunk`` only
    those of its own chunk of ``chunk`` positions (HF's chunked overlay, Llama 4)."""
    keys = jnp.arange(kv_length, dtype=jnp.int32)
    queries = positions[..., None]
    mask = queries >= keys
    if window is not None:
        mask = mask & (keys > queries - window)
    return mask if chunk is None else mask & (keys // chunk == queries // chunk)


def zeros_like_shapes(shapes: Any) -> Any:
    """A cache of zeros from the ``jax.ShapeDtypeStruct`` tree of a shape-taking apply."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def empty_cache(model: nn.Module, params: Any, rows: int, length: int) -> Any:
    """``model``'s cache of zeros for ``rows`` sequences of ``length`` positions (shapes from an abstract apply)."""

    def shape_taking(tokens: Array) -> Any:
        return model.apply({"params": params}, tokens, mutable=["cache"])[1]["cache"]

    return zeros_like_shapes(jax.eval_shape(shape_taking, jax.ShapeDtypeStruct((rows, length), jnp.int32)))


def repeated_rows(tree: Any, times: int) -> Any:
    """A cache (or per-row outputs) with each row repeated ``times`` times in place: every array holds the rows on
    its first axis, but the scalar cache index."""
    if times == 1:
        return tree
    return jax.tree.map(lambda array: jnp.repeat(array, times, axis=0) if array.ndim else array, tree)
