"""The gated delta rule's backward pass as one Pallas kernel for TPU (the VJP of
:func:`functrain.models.delta_rule_pallas.pallas_delta_rule`).

The forward kernel saves the state each chunk starts from (``[B, Hv, N, Dk, Dv]``). This kernel's grid is (batch,
key head, chunk) with the chunks taken from the last back to the first (``arbitrary``): the gradient of each value
head's state ``dS`` stays in VMEM scratch from chunk to chunk, starting from the final state's cotangent. A step
recomputes its chunk's decays, WY/UT inverse and corrected values from the saved state (as the forward does), takes
the gradient of the chunk's output and outgoing state back through them to the chunk's queries, keys, values,
cumulative decays and write strengths, and passes ``dS`` on to the chunk before. In a chunk, with ``W`` the
inverse of ``I + A`` (``A = beta K K^T * decays``, strictly lower), ``U = W (V beta) - W (K beta r) S`` the
corrected values and ``S' = g S + (K w)^T U``, ``out = (Q r) S + (Q K^T * decays) U``::

    dU = (Q K^T * decays)^T dout + (K w) dS'          dS = g dS' + (Q r)^T dout - (W K beta r)^T dU
    dA = -W^T dW W^T (strictly lower), dW = dU (V beta)^T - dU S^T (K beta r)^T

and the rest is the chain rule through the elementwise products (``r``, ``w``, ``g``: the decays from the chunk's
start, to its end, and over it). :func:`backward_call` turns the cumulative decays' gradient into the decays' (a
reversed cumulative sum per chunk); its caller takes the queries' and keys' normalisation's VJP.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from functrain.models.delta_rule_tiles import (
    chunk_blocks,
    chunk_operands,
    chunk_system,
    dot,
    inverse_flops,
)
from functrain.models.splash import is_interpreted

Array = jax.Array


def _row_sum(x: Array) -> Array:
    """``[C, D] -> [C, 1]``."""
    return jnp.sum(x, axis=1, keepdims=True)


def _backward_kernel(
    query_ref, key_ref, value_ref, cumulative_ref, cumulative_row_ref, beta_ref,
    run_ref, run_row_ref, carried_ref, to_end_ref, chunk_states_ref, out_grad_ref, final_grad_ref,
    query_grad_ref, key_grad_ref, value_grad_ref, cumulative_grad_ref, beta_grad_ref, initial_grad_ref, grad_ref,
) -> None:  # fmt: skip
    """One (row, key head, chunk) step, the chunks from the last: for each value head the key head serves, the
    gradients of the chunk's inputs, and of the state it started from (``grad_ref``: the states' gradient)."""
    step = pl.program_id(2)

    @pl.when(step == 0)
    def _start() -> None:
        grad_ref[...] = final_grad_ref[...]

    query, key, carried, to_end = query_ref[...], key_ref[...], carried_ref[...], to_end_ref[...]
    size = query.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    one_run = (run_ref[...] == run_row_ref[...]) & (rows >= columns)
    is_last = jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0) == size - 1
    key_products, query_key = dot(key, key, (1, 1)), dot(query, key, (1, 1))
    query_grad, key_grad = jnp.zeros_like(query), jnp.zeros_like(key)
    for head in range(value_ref.shape[0]):
        cumulative, beta, value = cumulative_ref[head], beta_ref[head], value_ref[head]  # [C, 1], [C, 1], [C, Dv]
        state, state_grad, out_grad = chunk_states_ref[head], grad_ref[head], out_grad_ref[head]
        # The forward's chunk, recomputed from the state it started from.
        pairwise, inverse, read_decay = chunk_system(
            one_run, cumulative, cumulative_row_ref[head], beta, key_products, carried
        )
        last = cumulative[size - 1 :, :]
        kept = jnp.exp(last) * carried[size - 1 :, :]  # [1, 1]
        write_decay = jnp.exp(last - cumulative) * to_end
        keys_in, values_in = key * (beta * read_decay), value * beta
        keys_read = dot(inverse, keys_in)
        corrected = dot(inverse, values_in) - dot(keys_read, state)
        scores = query_key * pairwise
        # Back through the output and the outgoing state.
        corrected_grad = dot(scores, out_grad, (0, 0)) + dot(key * write_decay, state_grad)
        grad_ref[head] = (
            state_grad * kept + dot(query * read_decay, out_grad, (0, 0)) - dot(keys_read, corrected_grad, (0, 0))
        )
        read_query_grad = dot(out_grad, state, (1, 1))  # of query * read_decay
        scores_grad = dot(out_grad, corrected, (1, 1))
        written_grad = dot(corrected, state_grad, (1, 1))  # of key * write_decay
        keys_read_grad = -dot(corrected_grad, state, (1, 1))
        # Back through the inverse: dA = -W^T dW W^T, on A's strictly lower part.
        inverse_grad = dot(corrected_grad, values_in, (1, 1)) + dot(keys_read_grad, keys_in, (1, 1))
        values_in_grad, keys_in_grad = dot(inverse, corrected_grad, (0, 0)), dot(inverse, keys_read_grad, (0, 0))
        system_grad = dot(dot(inverse, inverse_grad, (0, 0)), inverse, (1, 1))
        system_grad = jnp.where(rows > columns, -system_grad * pairwise, 0.0)  # of beta * key_products
        key_products_grad = system_grad * beta
        query_key_grad = scores_grad * pairwise
        query_grad = query_grad + read_query_grad * read_decay + dot(query_key_grad, key)
        key_grad = key_grad + dot(key_products_grad, key) + dot(key_products_grad, key, (0, 0))
        key_grad = key_grad + dot(query_key_grad, query, (0, 0)) + keys_in_grad * (beta * read_decay)
        key_grad = key_grad + written_grad * write_decay
        value_grad_ref[head] = values_in_grad * beta
        keys_in_product = _row_sum(keys_in_grad * key)
        written_beta = _row_sum(system_grad * key_products) + _row_sum(values_in_grad * value)
        beta_grad_ref[head] = written_beta + keys_in_product * read_decay
        # Back to the cumulative decays: through the pairwise decays (i's minus j's), from the start, to the end.
        decays_grad = query_key_grad * query_key + key_products_grad * key_products
        read_decay_grad = _row_sum(read_query_grad * query) + keys_in_product * beta
        write_decay_grad = _row_sum(written_grad * key) * write_decay
        last_grad = jnp.sum(write_decay_grad, axis=0, keepdims=True) + kept * jnp.sum(
            _row_sum(state * state_grad), axis=0, keepdims=True
        )
        cumulative_grad_ref[head] = (
            _row_sum(decays_grad) - dot(decays_grad, jnp.ones((size, 1), jnp.float32), (0, 0))
            + read_decay_grad * read_decay - write_decay_grad + jnp.where(is_last, last_grad, 0.0)
        )  # fmt: skip
    query_grad_ref[...], key_grad_ref[...] = query_grad, key_grad

    @pl.when(step == pl.num_programs(2) - 1)
    def _finish() -> None:
        initial_grad_ref[...] = grad_ref[...]


def backward_chunk_flops(size: int, key_dim: int, value_dim: int, groups: int) -> int:
    """Matmul FLOPs of one backward kernel step: a chunk of ``size`` tokens of one key head and its ``groups`` value
    heads (the kernel's cost estimate)."""
    shared = 2 * 2 * size * size * key_dim
    per_value_head = 2 * size * size * (7 * key_dim + 5 * value_dim + 1) + 7 * 2 * size * key_dim * value_dim
    return shared + groups * (inverse_flops(size) + 2 * 2 * size**3 + per_value_head)


def backward_call(
    query: Array, key: Array, value: Array, decay: Array, beta: Array, runs: Array, chunk_states: Array,
    out_grad: Array, final_grad: Array, size: int,
) -> tuple[Array, ...]:  # fmt: skip
    """The gradients of the forward kernel's inputs (padded to whole chunks: query, key [B, T, Hk, Dk], value
    [B, T, Hv, Dv], decay, beta [B, T, Hv], runs [B, T]) from the states each chunk started from and the output's
    and final state's cotangents: ``(query, key, value, decay, beta, initial state)``'s, in their shapes."""
    batch, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    groups, chunks = value_heads // key_heads, length // size
    in_specs, tokens, states_by_chunk, states = chunk_blocks(groups, size, key_dim, value_dim, chunks, reverse=True)
    keys, column = in_specs[0], in_specs[3]  # a key head's tokens, its value heads' per-token column
    steps = batch * key_heads * chunks
    cost = pl.CostEstimate(
        flops=steps * backward_chunk_flops(size, key_dim, value_dim, groups),
        transcendentals=steps * groups * (size * size + 3 * size),
        bytes_accessed=4 * (steps * size * (4 * key_dim + groups * (4 * value_dim + 6) + 4) + chunk_states.size)
        + 8 * final_grad.size,
    )
    shape = lambda *dims: jax.ShapeDtypeStruct(dims, jnp.float32)  # noqa: E731
    by_head = lambda x: jnp.moveaxis(x, 2, 1)  # noqa: E731  [B, T, H, ...] <-> [B, H, T, ...]
    query_grad, key_grad, value_grad, cumulative_grad, beta_grad, initial_grad = pl.pallas_call(
        _backward_kernel,
        grid=(batch, key_heads, chunks),
        in_specs=[*in_specs, states_by_chunk, tokens, states],
        out_specs=[keys, keys, tokens, column, column, states],
        out_shape=[shape(batch, key_heads, length, key_dim)] * 2 + [shape(batch, value_heads, length, value_dim)]
        + [shape(batch, value_heads, chunks, size, 1)] * 2 + [shape(*final_grad.shape)],
        scratch_shapes=[pltpu.VMEM((groups, key_dim, value_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=is_interpreted(),
        name="gated_delta_rule_backward",
    )(
        *(by_head(x) for x in (query, key, value)),
        *chunk_operands(decay, beta, runs, size),
        chunk_states,
        by_head(out_grad),
        final_grad,
    )  # fmt: skip
    # The cumulative sum's VJP: each decay's gradient is the sum of the later cumulative decays' in its chunk.
    decay_grad = jnp.flip(jnp.cumsum(jnp.flip(cumulative_grad[..., 0], -1), -1), -1)
    per_token = lambda x: jnp.moveaxis(x.reshape(batch, value_heads, length), 1, 2)  # noqa: E731
    grads = (by_head(query_grad), by_head(key_grad), by_head(value_grad), per_token(decay_grad))
    return (*grads, per_token(beta_grad[..., 0]), initial_grad)
