"""The gated delta rule (Gated DeltaNet's token mixing, Yang et al. 2024) and its short causal convolution, as pure
JAX functions with the maths of transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
and ``causal_conv1d_fn`` / ``causal_conv1d_update`` (Qwen3-Next, Qwen3.5).

Each value head keeps a state ``S`` [Dk, Dv]; token ``t`` decays it by ``exp(g_t)`` (``g_t <= 0``), writes the
correction ``beta_t * (v_t - S^T k_t)`` at its key, and reads it with its query::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T        o_t = S_t^T q_t

queries and keys L2-normalised, queries scaled by ``Dk ** -0.5``. Grouped heads: each query/key head serves
``Hv // Hk`` consecutive value heads.

- :func:`chunked_delta_rule`, for training and prompts: the sequence in chunks of ``chunk_size`` tokens, the
  updates within a chunk folded into matmuls by solving one unit lower-triangular system per chunk (the WY/UT
  form), the state carried from chunk to chunk by a ``lax.scan``;
- :func:`recurrent_delta_rule`, for decoding: one token at a time (a ``lax.scan`` over tokens).

Both take ``runs`` [B, T] (nondecreasing ids of the packed documents, :func:`document_runs`): the state starts
from zero where a run starts, so packed documents never see each other. Everything is computed in float32. The
FLOPs formula counts the chunked form's matmuls with :func:`functrain.models.configs.qwen3_next.delta_rule_flops`.
"""

import jax
import jax.numpy as jnp

Array = jax.Array
NORM_EPS = 1e-6  # transformers' (and FLA's) epsilon of the queries' and keys' L2 norm


def document_runs(segment_ids: Array | None, length: int, batch: int) -> Array:
    """``[B, T]`` int32 ids that change exactly where a packed document starts (a token whose segment id differs
    from the previous token's); all zeros without ``segment_ids``."""
    if segment_ids is None:
        return jnp.zeros((batch, length), jnp.int32)
    starts = (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), jnp.cumsum(starts, axis=1)], axis=1)


def l2_normalized(x: Array) -> Array:
    """``x / sqrt(sum(x^2) + eps)`` over the last axis (transformers' ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + NORM_EPS)


def _prepared(query: Array, key: Array, value: Array, decay: Array, beta: Array) -> tuple[Array, ...]:
    """Float32 inputs, queries and keys normalised and repeated over their value heads, queries scaled."""
    groups = value.shape[2] // key.shape[2]
    query, key = (jnp.repeat(l2_normalized(x.astype(jnp.float32)), groups, axis=2) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    return query, key, value.astype(jnp.float32), decay.astype(jnp.float32), beta.astype(jnp.float32)


def unit_lower_inverse(strictly_lower: Array) -> Array:
    """``(I + L)^-1`` for strictly lower-triangular ``L`` [..., C, C], by block inversion in matmuls alone: the
    inverse of ``[[A, 0], [B, D]]`` is ``[[A^-1, 0], [-D^-1 B A^-1, D^-1]]``, from 1x1 diagonal blocks up to the
    whole (padded to a power of two). A forward substitution's result in about ``C^3 / 3`` multiply-adds, with no
    triangular-solve kernel: XLA runs it as plain matmuls on every platform and counts its FLOPs (a LAPACK or
    cuBLAS solve is a custom call its cost analysis cannot see into)."""
    size = strictly_lower.shape[-1]
    padded = 1 << (size - 1).bit_length()
    lower = jnp.pad(strictly_lower, [(0, 0)] * (strictly_lower.ndim - 2) + [(0, padded - size)] * 2)
    inverse = jnp.ones((*lower.shape[:-2], padded, 1, 1), lower.dtype)  # the diagonal blocks' inverses
    block = 1
    while block < padded:
        pairs = padded // (2 * block)
        grid = lower.reshape(*lower.shape[:-2], pairs, 2, block, pairs, 2, block)[..., :, 1, :, :, 0, :]
        below = jnp.moveaxis(jnp.diagonal(grid, axis1=-4, axis2=-2), -1, -3)  # [..., pairs, block, block]
        upper_inverse, lower_inverse = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        corner = -(lower_inverse @ below @ upper_inverse)
        top = jnp.concatenate([upper_inverse, jnp.zeros_like(corner)], axis=-1)
        inverse = jnp.concatenate([top, jnp.concatenate([corner, lower_inverse], axis=-1)], axis=-2)
        block *= 2
    return inverse[..., 0, :size, :size]


def chunked_delta_rule(
    query: Array,
    key: Array,
    value: Array,
    decay: Array,
    beta: Array,
    *,
    chunk_size: int,
    runs: Array | None = None,
    initial_state: Array | None = None,
) -> tuple[Array, Array]:
    """The gated delta rule over whole chunks.

    Args:
      query, key: ``[B, T, Hk, Dk]``; value: ``[B, T, Hv, Dv]`` with ``Hv`` a multiple of ``Hk``.
      decay: ``[B, T, Hv]``, the log of each token's decay (``<= 0``); beta: ``[B, T, Hv]``, its write strength.
      chunk_size: tokens per chunk (the sequence is padded to a whole number of chunks).
      runs: ``[B, T]`` document ids (:func:`document_runs`); None: one document a row.
      initial_state: ``[B, Hv, Dk, Dv]`` float32 (None: zeros).

    Returns ``(out [B, T, Hv, Dv] float32, final state [B, Hv, Dk, Dv] float32)``.
    """
    query, key, value, decay, beta = _prepared(query, key, value, decay, beta)
    batch, length, heads, key_dim = key.shape
    size = chunk_size
    pad = -length % size
    runs = jnp.zeros((batch, length), jnp.int32) if runs is None else runs
    query, key, value = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (query, key, value))
    decay, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (decay, beta))
    runs = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge")  # padding continues the last document, writing nothing
    chunks = (length + pad) // size
    # [B, N, H, C, D] and [B, N, H, C]: chunk n holds tokens n*C .. n*C+C-1.
    query, key, value = (
        x.reshape(batch, chunks, size, heads, -1).transpose(0, 1, 3, 2, 4) for x in (query, key, value)
    )
    decay, beta = (x.reshape(batch, chunks, size, heads).transpose(0, 1, 3, 2) for x in (decay, beta))
    runs = runs.reshape(batch, chunks, 1, size)
    # The run just before each chunk (the first chunk's own first, so an initial state reaches its first run).
    before = jnp.concatenate([runs[:, :1, :, :1], runs[:, :-1, :, -1:]], axis=1)
    carried = runs == before  # [B, N, 1, C]: still in the run the state comes from
    same_run = runs[..., :, None] == runs[..., None, :]  # [B, N, 1, C, C]

    cumulative = jnp.cumsum(decay, axis=-1)  # [B, N, H, C]: log of the decay from the chunk's start to each token
    lower = jnp.tril(jnp.ones((size, size), bool))
    # exp of the decay between key j and query i (j <= i, one run), 0 elsewhere; masked before exp: never overflows.
    pairwise = jnp.exp(jnp.where(lower & same_run, cumulative[..., :, None] - cumulative[..., None, :], -jnp.inf))
    key_beta, value_beta = key * beta[..., None], value * beta[..., None]
    # The chunk's updates as one unit lower-triangular system (the WY/UT form), inverted once.
    strictly_lower = jnp.where(jnp.eye(size, dtype=bool), 0.0, key_beta @ jnp.swapaxes(key, -1, -2))
    inverse = unit_lower_inverse(strictly_lower * pairwise)
    scores = query @ jnp.swapaxes(key, -1, -2) * pairwise
    read_decay = (jnp.exp(cumulative) * carried)[..., None]  # zero once a new document starts in the chunk
    solved = inverse @ jnp.concatenate([value_beta, key_beta * read_decay], axis=-1)
    new_values, decayed_keys = solved[..., : value.shape[-1]], solved[..., value.shape[-1] :]
    write_decay = jnp.exp(cumulative[..., -1:] - cumulative) * (runs == runs[..., -1:])  # what reaches the end
    chunk_decay = jnp.exp(cumulative[..., -1]) * carried[..., -1]  # [B, N, H]: 0 if a document starts inside

    def one_chunk(state: Array, chunk: tuple[Array, ...]) -> tuple[Array, Array]:
        values, keys_read, queries, scores, keys_written, kept = chunk
        corrected = values - keys_read @ state  # [B, H, C, Dv]: what the state does not already predict
        out = queries @ state + scores @ corrected
        return state * kept[..., None, None] + jnp.swapaxes(keys_written, -1, -2) @ corrected, out

    state = jnp.zeros((batch, heads, key_dim, value.shape[-1]), jnp.float32) if initial_state is None else initial_state
    by_chunk = (new_values, decayed_keys, query * read_decay, scores, key * write_decay[..., None], chunk_decay)
    state, out = jax.lax.scan(
        one_chunk, state.astype(jnp.float32), jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), by_chunk)
    )
    out = out.transpose(1, 0, 3, 2, 4).reshape(batch, chunks * size, heads, -1)  # [N, B, H, C, Dv] -> [B, T, H, Dv]
    return out[:, :length], state


def recurrent_delta_rule(
    query: Array,
    key: Array,
    value: Array,
    decay: Array,
    beta: Array,
    *,
    runs: Array | None = None,
    initial_state: Array | None = None,
) -> tuple[Array, Array]:
    """The gated delta rule one token at a time: the arguments and result of :func:`chunked_delta_rule` (no chunk
    size)."""
    query, key, value, decay, beta = _prepared(query, key, value, decay, beta)
    batch, length, heads, key_dim = key.shape
    runs = jnp.zeros((batch, length), jnp.int32) if runs is None else runs
    starts = jnp.concatenate([jnp.zeros((batch, 1), bool), runs[:, 1:] != runs[:, :-1]], axis=1)

    def one_token(state: Array, token: tuple[Array, ...]) -> tuple[Array, Array]:
        q, k, v, g, b, start = token  # [B, H, D] / [B, H] / [B]
        state = jnp.where(start[:, None, None, None], 0.0, state) * jnp.exp(g)[..., None, None]
        remembered = jnp.einsum("bhkv,bhk->bhv", state, k)
        state = state + k[..., :, None] * ((v - remembered) * b[..., None])[..., None, :]
        return state, jnp.einsum("bhkv,bhk->bhv", state, q)

    state = jnp.zeros((batch, heads, key_dim, value.shape[-1]), jnp.float32) if initial_state is None else initial_state
    tokens = jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), (query, key, value, decay, beta, starts))
    state, out = jax.lax.scan(one_token, state.astype(jnp.float32), tokens)
    return jnp.moveaxis(out, 0, 1), state


def causal_conv(
    x: Array, kernel: Array, *, runs: Array | None = None, state: Array | None = None
) -> tuple[Array, Array]:
    """A depthwise causal convolution: ``out[t, c] = sum_j kernel[j, c] * x[t - K + 1 + j, c]``.

    Args:
      x: ``[B, T, C]``; kernel: ``[K, C]`` (transformers' ``conv1d.weight`` [C, 1, K] transposed).
      runs: ``[B, T]`` document ids: a token sees only the inputs of its own document.
      state: ``[B, K - 1, C]``, the inputs before ``x`` (decoding; None: zeros, a sequence's start).

    Returns ``(out [B, T, C] in x's dtype, the last K - 1 inputs [B, K - 1, C]: the next call's state)``.
    """
    width = kernel.shape[0]
    batch, length, _ = x.shape
    past = jnp.zeros((batch, width - 1, x.shape[-1]), x.dtype) if state is None else state.astype(x.dtype)
    padded = jnp.concatenate([past, x], axis=1)  # [B, T + K - 1, C]
    if runs is not None:  # the state is the first document's past
        runs = jnp.concatenate([jnp.repeat(runs[:, :1], width - 1, axis=1), runs], axis=1)
    out = jnp.zeros(x.shape, jnp.promote_types(x.dtype, kernel.dtype))
    for offset in range(width):
        window = padded[:, offset : offset + length]
        if runs is not None:
            window = jnp.where((runs[:, offset : offset + length] == runs[:, width - 1 :])[..., None], window, 0)
        out = out + window * kernel[offset]
    return out.astype(x.dtype), padded[:, length:]
