"""What the gated delta rule's Pallas kernels share (:mod:`functrain.models.delta_rule_pallas`, forward, and
:mod:`functrain.models.delta_rule_pallas_backward`): float32 matmuls, the unit lower-triangular inverse by squaring,
a chunk's decays and system (which the backward recomputes as the forward computed them), the per-chunk operands
(decays, write strengths, document runs) laid out as the kernels read them, and the blocks a grid step (row, key
head, chunk) takes of each."""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST


def dot(a: Array, b: Array, contract: tuple[int, int] = (1, 0)) -> Array:
    """``a @ b`` contracting ``a``'s axis ``contract[0]`` with ``b``'s ``contract[1]``, in float32."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=HIGHEST, preferred_element_type=jnp.float32)


def unit_lower_inverse_by_squaring(strictly_lower: Array) -> Array:
    """``(I + L)^-1`` for a strictly lower-triangular ``L`` [C, C]: ``L`` is nilpotent, so the Neumann series
    ``sum_k (-L)^k`` ends and factors as ``prod_i (I + (-L)^(2^i))`` over ``2^i < C``: aligned ``[C, C]`` matmuls
    alone, which Mosaic lowers (no triangular solve, no unaligned blocks)."""
    size = strictly_lower.shape[-1]
    power = -strictly_lower
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    inverse = jnp.where(rows == jax.lax.broadcasted_iota(jnp.int32, (size, size), 1), 1.0, 0.0) + power
    reach = 2
    while reach < size:
        power = dot(power, power)
        inverse = inverse + dot(inverse, power)
        reach *= 2
    return inverse


def chunk_system(
    one_run: Array, cumulative: Array, cumulative_row: Array, beta: Array, key_products: Array, carried: Array
) -> tuple[Array, Array, Array]:
    """A value head's chunk as both kernels compute it (the backward recomputes the forward's): ``(pairwise,
    inverse, read_decay)``. ``pairwise`` [C, C]: the decay between key j and query i (j <= i in one document run,
    ``one_run``), 0 elsewhere (masked before exp: no overflow); ``inverse``: ``(I + A)^-1`` with ``A = beta K K^T *
    pairwise`` strictly lower; ``read_decay`` [C, 1]: each token's decay from the chunk's start, 0 once a new
    document starts in the chunk (``carried``). ``cumulative`` [C, 1] and ``cumulative_row`` [1, C]: the cumulative
    decays; ``beta`` [C, 1]; ``key_products``: ``K K^T``."""
    size = key_products.shape[0]
    strictly_lower = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0) > jax.lax.broadcasted_iota(
        jnp.int32, (size, size), 1
    )
    pairwise = jnp.exp(jnp.where(one_run, cumulative - cumulative_row, -jnp.inf))
    inverse = unit_lower_inverse_by_squaring(jnp.where(strictly_lower, beta * key_products * pairwise, 0.0))
    return pairwise, inverse, jnp.exp(cumulative) * carried


def inverse_flops(size: int) -> int:
    """Matmul FLOPs of :func:`unit_lower_inverse_by_squaring` on a ``[size, size]`` matrix."""
    squarings = max((size - 1).bit_length() - 1, 0)
    return 2 * squarings * 2 * size**3


def by_chunk(x: Array, chunks: int, size: int) -> Array:
    """``[B, T, H, ...]`` (T = chunks * size) -> ``[B, H, N, C, ...]``."""
    x = x.reshape(x.shape[0], chunks, size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def chunk_operands(decay: Array, beta: Array, runs: Array, size: int) -> list[Array]:
    """The per-token operands of a kernel step, from decay, beta [B, T, Hv] and runs [B, T] padded to whole chunks:
    per value head the cumulative decay within the chunk as a column [B, Hv, N, C, 1] and a row [.., 1, C] and beta
    as a column; per row the runs as a column [B, N, C, 1] and a row [B, N, 1, C], and as columns whether a token
    is still in the run the chunk's state comes from (``carried``) and in the run that ends the chunk."""
    batch, length = runs.shape
    chunks = length // size
    cumulative = jnp.cumsum(by_chunk(decay, chunks, size), axis=-1)  # [B, Hv, N, C]
    beta = by_chunk(beta, chunks, size)
    runs = runs.reshape(batch, chunks, size)
    before = jnp.concatenate([runs[:, :1, :1], runs[:, :-1, -1:]], axis=1)  # the run each chunk's state comes from
    carried, to_end = (runs == before), (runs == runs[..., -1:])
    as_float = lambda x: x.astype(jnp.float32)  # noqa: E731
    return [cumulative[..., None], cumulative[..., None, :], beta[..., None], as_float(runs)[..., None],
            as_float(runs)[..., None, :], as_float(carried)[..., None], as_float(to_end)[..., None]]  # fmt: skip


def chunk_blocks(
    groups: int, size: int, key_dim: int, value_dim: int, chunks: int, *, reverse: bool = False
) -> tuple[list[pl.BlockSpec], pl.BlockSpec, pl.BlockSpec, pl.BlockSpec]:
    """The blocks step (b, h, n) of a grid (batch, key head, chunk) takes: of chunk ``n`` (``reverse``: the ``n``-th
    from the end, for a pass from the last chunk back), ``(the inputs' [query, key, value, *chunk_operands], the
    value heads' tokens [B, Hv, T, Dv], the value heads' chunk states [B, Hv, N, Dk, Dv], the value heads' states
    [B, Hv, Dk, Dv] whatever the chunk)``."""
    order = (lambda n: chunks - 1 - n) if reverse else (lambda n: n)

    def block(*shape: int | None, per_row: bool = False) -> pl.BlockSpec:
        """Of row b's chunk, key head h's (or its value heads'; ``per_row``: every head's) block."""
        if per_row:  # [B, N, ...]
            return pl.BlockSpec(shape, lambda b, h, n: (b, order(n), 0, 0))
        return pl.BlockSpec(shape, lambda b, h, n: (b, h, order(n), *([0] * (len(shape) - 3))))

    column, row = (None, groups, None, size, 1), (None, groups, None, 1, size)
    tokens = block(None, groups, size, value_dim)
    inputs = [block(None, None, size, key_dim)] * 2 + [tokens, block(*column), block(*row), block(*column)]
    inputs += [block(None, None, size, 1, per_row=True), block(None, None, 1, size, per_row=True)]
    inputs += [block(None, None, size, 1, per_row=True)] * 2
    chunk_states = block(None, groups, None, key_dim, value_dim)
    states = pl.BlockSpec((None, groups, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))
    return inputs, tokens, chunk_states, states
