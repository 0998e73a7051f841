"""Softmax attention under a mask written out as an array: what decoding with a KV cache, context parallelism
(:mod:`functrain.models.context_attention`) and the fused forms no XLA kernel offers (soft-capped scores,
attention sinks) run on."""

import jax
import jax.numpy as jnp

Array = jax.Array


def segment_mask(query_segments: Array, key_segments: Array | None = None) -> Array:
    """``[B, 1, T, S]``: True where a query token and a key token belong to the same segment (the keys' segment ids
    ``[B, S]`` are the queries' ``[B, T]`` unless given)."""
    keys = query_segments if key_segments is None else key_segments
    return (query_segments[:, :, None] == keys[:, None, :])[:, None]


def chunk_segments(segment_ids: Array | None, batch: int, length: int, chunk: int) -> Array:
    """``[B, T]`` ids that split each segment (the whole row without ``segment_ids``) into chunks of ``chunk``
    tokens counted from the segment's start, where packed documents restart their positions: attending within
    these ids is chunked attention (Llama 4's ``attention_chunk_size``)."""
    index = jnp.arange(length, dtype=jnp.int32)
    if segment_ids is None:
        return jnp.broadcast_to(index // chunk, (batch, length))
    starts = jnp.concatenate(
        [jnp.ones((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )  # a segment's first token
    segment_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
    return jnp.cumsum(starts | ((index - segment_start) % chunk == 0), axis=1, dtype=jnp.int32)


def masked_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    mask: Array,
    softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """Attention of ``[B, T, H, D]`` queries over ``[B, S, KV, D]`` keys and values where ``mask`` (``[B or 1, 1,
    T, S]`` bool) is True; soft-capped scores and sinks as :func:`functrain.models.attention.attend` takes them.
    Returns ``[B, T, H, D]`` in the query's dtype."""
    if softcap is None and sinks is None:
        return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale, implementation="xla")
    return _written_out(query, key, value, scale, mask, softcap, sinks)


def _written_out(
    query: Array,
    key: Array,
    value: Array,
    scale: float,
    mask: Array,
    softcap: float | None,
    sinks: Array | None,
) -> Array:
    """Soft-capped attention or attention with sinks, which no fused XLA kernel offers: grouped-query einsums,
    float32 scores."""
    batch, length, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    # Group query heads under their shared key/value head instead of repeating k and v in memory.
    grouped = query.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = jnp.tanh(scores / softcap) * softcap
    scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        # Each head's sink is one more column of its softmax, dropped afterwards (HF's eager GPT-OSS attention).
        sink_column = jnp.broadcast_to(
            sinks.astype(jnp.float32).reshape(1, kv_heads, heads // kv_heads, 1, 1), scores.shape[:-1] + (1,)
        )
        probs = jax.nn.softmax(jnp.concatenate([scores, sink_column], axis=-1), axis=-1)[..., :-1]
    probs = probs.astype(value.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, value).reshape(batch, length, heads, head_dim)
