"""The chunked gated delta rule as one Pallas kernel for TPU (``model.gdn_kernel=pallas``).

:func:`functrain.models.delta_rule.chunked_delta_rule` is XLA's: it writes every chunk's ``[C, C]`` decays, scores,
triangular system and inverse to HBM, and then carries the state with a ``lax.scan`` that reads them back.
:func:`pallas_delta_rule` computes the same maths in one ``pallas_call`` whose grid is (batch, key head, chunk): the
chunk axis is sequential (``arbitrary``) and the states ``S`` [Dk, Dv] of the key head's value heads stay in VMEM
scratch from chunk to chunk, so HBM sees only the queries, keys, values and per-token scalars coming in and the
output going out. A step takes one key head's chunk and the value heads it serves (grouped heads: queries and keys
are read once for them, never repeated in HBM, and their ``[C, C]`` products computed once); for each value head it
builds the decays between tokens, solves the WY/UT system by inverting its unit lower-triangular matrix
(:func:`unit_lower_inverse_by_squaring`: ``(I + L)^-1 = prod_i (I + (-L)^(2^i))``, five ``[C, C]`` matmul pairs at
``C = 64``, no triangular solve), and reads and updates that head's state.

The backward pass is XLA's: :func:`pallas_delta_rule` is a ``custom_vjp`` whose backward recomputes the XLA form
and takes its VJP (a training step pays the kernel's forward and XLA's forward and backward; only a forward pass,
prefill or evaluation, gains the kernel alone).

The kernel is Mosaic's (TPU): on any other platform :func:`delta_rule_kernel` refuses ``pallas`` in one line,
unless inside :func:`functrain.models.splash.interpreted` (the tests' switch for every Pallas kernel), where it runs
in the Pallas interpreter. Everything is float32, as in the XLA form.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from functrain.errors import ConfigError
from functrain.models.configs.qwen3_next import GdnKernel
from functrain.models.delta_rule import chunked_delta_rule, l2_normalized
from functrain.models.splash import is_interpreted, shard_specs
from functrain.parallel.target import target_name, target_platform

Array = jax.Array
HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a: Array, b: Array, contract: tuple[int, int] = (1, 0)) -> Array:
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
        power = _dot(power, power)
        inverse = inverse + _dot(inverse, power)
        reach *= 2
    return inverse


def _chunk_kernel(
    query_ref, key_ref, value_ref, cumulative_ref, cumulative_row_ref, beta_ref,
    run_ref, run_row_ref, carried_ref, to_end_ref, initial_ref,
    out_ref, final_ref, state_ref,
) -> None:  # fmt: skip
    """One (row, key head, chunk) step: for each value head the key head serves, the chunk's output from its state,
    then its state after the chunk. The key head's scores and key products are computed once for them all."""
    chunk = pl.program_id(2)

    @pl.when(chunk == 0)
    def _start() -> None:
        state_ref[...] = initial_ref[...]

    query, key, carried = query_ref[...], key_ref[...], carried_ref[...]  # [C, Dk], [C, Dk], [C, 1]
    size = query.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    one_run = (run_ref[...] == run_row_ref[...]) & (rows >= columns)
    key_products, query_key = _dot(key, key, (1, 1)), _dot(query, key, (1, 1))
    for head in range(value_ref.shape[0]):
        cumulative, beta = cumulative_ref[head], beta_ref[head]  # [C, 1] each
        # exp of the decay between key j and query i (j <= i, one run), 0 elsewhere; masked before exp: no overflow.
        pairwise = jnp.exp(jnp.where(one_run, cumulative - cumulative_row_ref[head], -jnp.inf))
        inverse = unit_lower_inverse_by_squaring(jnp.where(rows > columns, beta * key_products * pairwise, 0.0))
        read_decay = jnp.exp(cumulative) * carried  # zero once a new document starts in the chunk
        state = state_ref[head]
        keys_read = _dot(inverse, key * (beta * read_decay))
        corrected = _dot(inverse, value_ref[head] * beta) - _dot(keys_read, state)
        out_ref[head] = _dot(query * read_decay, state) + _dot(query_key * pairwise, corrected)
        last = cumulative[size - 1 :, :]  # [1, 1]
        written = key * (jnp.exp(last - cumulative) * to_end_ref[...])  # what of each key reaches the chunk's end
        state_ref[head] = state * (jnp.exp(last) * carried[size - 1 :, :]) + _dot(written, corrected, (0, 0))

    @pl.when(chunk == pl.num_programs(2) - 1)
    def _finish() -> None:
        final_ref[...] = state_ref[...]


def chunk_flops(size: int, key_dim: int, value_dim: int, groups: int) -> int:
    """Matmul FLOPs of one kernel step: a chunk of ``size`` tokens of one key head and its ``groups`` value heads
    (the kernel's cost estimate, which a plan counts: :func:`functrain.plan.counting.kernel_flops`)."""
    squarings = max((size - 1).bit_length() - 1, 0)
    inverse = 2 * squarings * 2 * size**3
    shared = 2 * 2 * size * size * key_dim
    per_value_head = 2 * size * size * (key_dim + 2 * value_dim) + 3 * 2 * size * key_dim * value_dim
    return shared + groups * (inverse + per_value_head)


def _by_chunk(x: Array, chunks: int, size: int) -> Array:
    """``[B, T, H, ...]`` (T = chunks * size) -> ``[B, H, N, C, ...]``."""
    x = x.reshape(x.shape[0], chunks, size, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def _kernel_call(
    query: Array, key: Array, value: Array, decay: Array, beta: Array, runs: Array, initial_state: Array, size: int
) -> tuple[Array, Array]:
    """The ``pallas_call`` on inputs padded to whole chunks: query, key [B, T, Hk, Dk] (normalised, the queries
    scaled), value [B, T, Hv, Dv], decay, beta [B, T, Hv], runs [B, T] (int32), initial_state [B, Hv, Dk, Dv]."""
    batch, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    groups, chunks = value_heads // key_heads, length // size
    cumulative = jnp.cumsum(_by_chunk(decay, chunks, size), axis=-1)  # [B, Hv, N, C]
    beta = _by_chunk(beta, chunks, size)
    runs = runs.reshape(batch, chunks, size)
    before = jnp.concatenate([runs[:, :1, :1], runs[:, :-1, -1:]], axis=1)  # the run each chunk's state comes from
    carried, to_end = (runs == before), (runs == runs[..., -1:])
    as_float = lambda x: x.astype(jnp.float32)  # noqa: E731
    head_columns = [cumulative[..., None], cumulative[..., None, :], beta[..., None]]
    row_columns = [as_float(runs)[..., None], as_float(runs)[..., None, :], as_float(carried)[..., None]]
    row_columns.append(as_float(to_end)[..., None])

    def block(*shape: int | None, per_row: bool = False) -> pl.BlockSpec:
        """Step (b, h, n)'s block: of row b's chunk n, key head h's (or its value heads'; ``per_row``: every
        head's)."""
        if per_row:  # [B, N, ...]
            return pl.BlockSpec(shape, lambda b, h, n: (b, n, 0, 0))
        return pl.BlockSpec(shape, lambda b, h, n: (b, h, n, *([0] * (len(shape) - 3))))

    column, row = (None, groups, None, size, 1), (None, groups, None, 1, size)
    in_specs = [block(None, None, size, key_dim)] * 2 + [block(None, groups, size, value_dim)]
    in_specs += [block(*column), block(*row), block(*column)]
    in_specs += [block(None, None, size, 1, per_row=True), block(None, None, 1, size, per_row=True)]
    in_specs += [block(None, None, size, 1, per_row=True)] * 2
    state_spec = pl.BlockSpec((None, groups, key_dim, value_dim), lambda b, h, n: (b, h, 0, 0))
    steps = batch * key_heads * chunks
    cost = pl.CostEstimate(
        flops=steps * chunk_flops(size, key_dim, value_dim, groups),
        transcendentals=steps * groups * (size * size + 2 * size),
        bytes_accessed=4 * steps * size * (2 * key_dim + groups * (2 * value_dim + 4) + 4) + 8 * initial_state.size,
    )
    out, final = pl.pallas_call(
        _chunk_kernel,
        grid=(batch, key_heads, chunks),
        in_specs=[*in_specs, state_spec],
        out_specs=[block(None, groups, size, value_dim), state_spec],
        out_shape=[
            jax.ShapeDtypeStruct((batch, value_heads, length, value_dim), jnp.float32),
            jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
        ],
        scratch_shapes=[pltpu.VMEM((groups, key_dim, value_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=is_interpreted(),
        name="gated_delta_rule",
    )(
        *(jnp.moveaxis(x, 2, 1) for x in (query, key, value)),
        *head_columns,
        *row_columns,
        initial_state,
    )
    return jnp.moveaxis(out, 1, 2), final


def _forward(query, key, value, decay, beta, runs, initial_state, chunk_size):
    """The kernel on the delta rule's inputs (the arguments of :func:`pallas_delta_rule`)."""
    length = key.shape[1]
    pad = -length % chunk_size
    query, key = (l2_normalized(x.astype(jnp.float32)) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    padded = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    runs = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge")  # padding continues the last document, writing nothing
    query, key, value, decay, beta = (padded(x) for x in (query, key, value, decay, beta))
    out, final = _kernel_call(query, key, value, decay, beta, runs, initial_state.astype(jnp.float32), chunk_size)
    return out[:, :length], final


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _delta_rule(query, key, value, decay, beta, runs, initial_state, chunk_size):
    return _forward(query, key, value, decay, beta, runs, initial_state, chunk_size)


def _delta_rule_fwd(query, key, value, decay, beta, runs, initial_state, chunk_size):
    saved = (query, key, value, decay, beta, runs, initial_state)
    return _forward(query, key, value, decay, beta, runs, initial_state, chunk_size), saved


def _delta_rule_bwd(chunk_size, saved, cotangents):
    """XLA's VJP: the chunked XLA form recomputed, and differentiated."""
    *differentiable, runs, initial_state = saved

    def xla_form(query, key, value, decay, beta, state):
        return chunked_delta_rule(query, key, value, decay, beta, chunk_size=chunk_size, runs=runs, initial_state=state)

    _, vjp = jax.vjp(xla_form, *differentiable, initial_state)
    *grads, state_grad = vjp(cotangents)
    return (*grads, None, state_grad)


_delta_rule.defvjp(_delta_rule_fwd, _delta_rule_bwd)


def pallas_delta_rule(
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
    """:func:`functrain.models.delta_rule.chunked_delta_rule` (the same arguments and result) computed by the
    Pallas kernel; its gradient is the XLA form's."""
    batch, length, _, key_dim = key.shape
    runs = jnp.zeros((batch, length), jnp.int32) if runs is None else runs
    if initial_state is None:
        initial_state = jnp.zeros((batch, value.shape[2], key_dim, value.shape[3]), jnp.float32)

    def rule(*arrays: Array) -> tuple[Array, Array]:
        return _delta_rule(*arrays, chunk_size)

    specs = shard_specs(batch, value.shape[2], key.shape[2])
    if specs is not None:  # XLA cannot partition a Pallas call: each device runs its rows and heads
        tokens, per_row, _ = specs
        per_token = PartitionSpec(*tokens[:3])
        state = PartitionSpec(tokens[0], tokens[2], None, None)
        in_specs = (tokens, tokens, tokens, per_token, per_token, per_row, state)
        rule = jax.shard_map(rule, in_specs=in_specs, out_specs=(tokens, state), check_vma=False)
    return rule(query, key, value, decay, beta, runs, initial_state)


def delta_rule_kernel(choice: GdnKernel) -> Callable[..., tuple[Array, Array]]:
    """The chunked delta rule ``model.gdn_kernel=choice`` runs: XLA's anywhere, the Pallas kernel on a TPU (or in
    the Pallas interpreter). Raises ConfigError (one line) for ``pallas`` elsewhere."""
    if choice == "xla":
        return chunked_delta_rule
    if target_platform() != "tpu" and not is_interpreted():
        raise ConfigError(
            f"model.gdn_kernel=pallas needs a TPU (its kernel is Mosaic's) and this run's devices are "
            f"{target_name()}; set model.gdn_kernel=xla"
        )
    return pallas_delta_rule
