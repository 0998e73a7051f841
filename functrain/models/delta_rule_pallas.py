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

The backward pass is a kernel too: :func:`pallas_delta_rule` is a ``custom_vjp`` whose forward also writes the
state each chunk starts from (``[B, Hv, N, Dk, Dv]``, its residual) and whose backward is the kernel of
:mod:`functrain.models.delta_rule_pallas_backward`, which carries the states' gradient over the chunks backward in
VMEM; only the normalisation of queries and keys and the padding are differentiated by XLA.

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
from functrain.models.delta_rule_pallas_backward import backward_call
from functrain.models.delta_rule_tiles import (
    chunk_blocks,
    chunk_operands,
    chunk_system,
    dot,
    inverse_flops,
)
from functrain.models.splash import is_interpreted, shard_specs
from functrain.parallel.target import target_name, target_platform

Array = jax.Array


def _chunk_kernel(
    query_ref, key_ref, value_ref, cumulative_ref, cumulative_row_ref, beta_ref,
    run_ref, run_row_ref, carried_ref, to_end_ref, initial_ref,
    out_ref, final_ref, *state_refs,
) -> None:  # fmt: skip
    """One (row, key head, chunk) step: for each value head the key head serves, the chunk's output from its state,
    then its state after the chunk. The key head's scores and key products are computed once for them all.
    ``state_refs``: the states' scratch, after (for the backward kernel) each chunk's incoming states' block."""
    *chunk_states_ref, state_ref = state_refs
    chunk = pl.program_id(2)

    @pl.when(chunk == 0)
    def _start() -> None:
        state_ref[...] = initial_ref[...]

    query, key, carried = query_ref[...], key_ref[...], carried_ref[...]  # [C, Dk], [C, Dk], [C, 1]
    size = query.shape[0]
    rows = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    columns = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    one_run = (run_ref[...] == run_row_ref[...]) & (rows >= columns)
    key_products, query_key = dot(key, key, (1, 1)), dot(query, key, (1, 1))
    for head in range(value_ref.shape[0]):
        cumulative, beta = cumulative_ref[head], beta_ref[head]  # [C, 1] each
        pairwise, inverse, read_decay = chunk_system(
            one_run, cumulative, cumulative_row_ref[head], beta, key_products, carried
        )
        state = state_ref[head]
        if chunk_states_ref:
            chunk_states_ref[0][head] = state
        keys_read = dot(inverse, key * (beta * read_decay))
        corrected = dot(inverse, value_ref[head] * beta) - dot(keys_read, state)
        out_ref[head] = dot(query * read_decay, state) + dot(query_key * pairwise, corrected)
        last = cumulative[size - 1 :, :]  # [1, 1]
        written = key * (jnp.exp(last - cumulative) * to_end_ref[...])  # what of each key reaches the chunk's end
        state_ref[head] = state * (jnp.exp(last) * carried[size - 1 :, :]) + dot(written, corrected, (0, 0))

    @pl.when(chunk == pl.num_programs(2) - 1)
    def _finish() -> None:
        final_ref[...] = state_ref[...]


def chunk_flops(size: int, key_dim: int, value_dim: int, groups: int) -> int:
    """Matmul FLOPs of one kernel step: a chunk of ``size`` tokens of one key head and its ``groups`` value heads
    (the kernel's cost estimate, which a plan counts: :func:`functrain.plan.counting.kernel_cost`)."""
    inverse = inverse_flops(size)
    shared = 2 * 2 * size * size * key_dim
    per_value_head = 2 * size * size * (key_dim + 2 * value_dim) + 3 * 2 * size * key_dim * value_dim
    return shared + groups * (inverse + per_value_head)


def _kernel_call(
    query: Array, key: Array, value: Array, decay: Array, beta: Array, runs: Array, initial_state: Array, size: int,
    *, chunk_states: bool = False,
) -> tuple[Array, ...]:  # fmt: skip
    """The ``pallas_call`` on inputs padded to whole chunks (:func:`_kernel_inputs`) and initial_state
    [B, Hv, Dk, Dv]: ``(out [B, T, Hv, Dv], final state)``, and with ``chunk_states`` the states each chunk starts
    from [B, Hv, N, Dk, Dv] (what the backward kernel reads)."""
    batch, length, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[2:]
    groups, chunks = value_heads // key_heads, length // size
    in_specs, tokens, states_by_chunk, states = chunk_blocks(groups, size, key_dim, value_dim, chunks)
    steps = batch * key_heads * chunks
    state_bytes = 4 * initial_state.size * (2 + chunks * chunk_states)
    cost = pl.CostEstimate(
        flops=steps * chunk_flops(size, key_dim, value_dim, groups),
        transcendentals=steps * groups * (size * size + 2 * size),
        bytes_accessed=4 * steps * size * (2 * key_dim + groups * (2 * value_dim + 4) + 4) + state_bytes,
    )
    out_specs = [tokens, states] + [states_by_chunk] * chunk_states
    out_shape = [
        jax.ShapeDtypeStruct((batch, value_heads, length, value_dim), jnp.float32),
        jax.ShapeDtypeStruct(initial_state.shape, jnp.float32),
    ]
    out_shape += [jax.ShapeDtypeStruct((batch, value_heads, chunks, key_dim, value_dim), jnp.float32)] * chunk_states
    out, final, *by_chunk = pl.pallas_call(
        _chunk_kernel,
        grid=(batch, key_heads, chunks),
        in_specs=[*in_specs, states],
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((groups, key_dim, value_dim), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=is_interpreted(),
        name="gated_delta_rule",
    )(
        *(jnp.moveaxis(x, 2, 1) for x in (query, key, value)),
        *chunk_operands(decay, beta, runs, size),
        initial_state,
    )
    return jnp.moveaxis(out, 1, 2), final, *by_chunk


def _kernel_inputs(
    query: Array, key: Array, value: Array, decay: Array, beta: Array, chunk_size: int
) -> tuple[Array, Array, Array, Array, Array]:
    """The kernels' float32 inputs: queries and keys normalised (queries scaled), every input padded to whole
    chunks with zeros (padding writes nothing)."""
    pad = -key.shape[1] % chunk_size
    query, key = (l2_normalized(x.astype(jnp.float32)) for x in (query, key))
    query = query * query.shape[-1] ** -0.5
    padded = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return padded(query), padded(key), padded(value), padded(decay), padded(beta)


def _padded_runs(runs: Array, chunk_size: int) -> Array:
    """Runs padded to whole chunks: padding continues the last document."""
    return jnp.pad(runs, ((0, 0), (0, -runs.shape[1] % chunk_size)), mode="edge")


def _forward(query, key, value, decay, beta, runs, initial_state, chunk_size, chunk_states=False):
    """The kernel on the delta rule's inputs (the arguments of :func:`pallas_delta_rule`)."""
    inputs = _kernel_inputs(query, key, value, decay, beta, chunk_size)
    out, *rest = _kernel_call(
        *inputs, _padded_runs(runs, chunk_size), initial_state.astype(jnp.float32), chunk_size,
        chunk_states=chunk_states,
    )  # fmt: skip
    return out[:, : key.shape[1]], *rest


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _delta_rule(query, key, value, decay, beta, runs, initial_state, chunk_size):
    return _forward(query, key, value, decay, beta, runs, initial_state, chunk_size)


def _delta_rule_fwd(query, key, value, decay, beta, runs, initial_state, chunk_size):
    out, final, chunk_states = _forward(query, key, value, decay, beta, runs, initial_state, chunk_size, True)
    return (out, final), (query, key, value, decay, beta, runs, initial_state, chunk_states)


def _delta_rule_bwd(chunk_size, saved, cotangents):
    """The backward kernel on the states each chunk started from, then the normalisation's and padding's VJP."""
    *differentiable, runs, initial_state, chunk_states = saved
    inputs, inputs_vjp = jax.vjp(functools.partial(_kernel_inputs, chunk_size=chunk_size), *differentiable)
    out_grad, final_grad = cotangents
    pad = inputs[0].shape[1] - out_grad.shape[1]
    out_grad = jnp.pad(out_grad.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
    *grads, state_grad = backward_call(
        *inputs, _padded_runs(runs, chunk_size), chunk_states, out_grad, final_grad.astype(jnp.float32), chunk_size
    )
    return (*inputs_vjp(tuple(grads)), None, state_grad.astype(initial_state.dtype))


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
    Pallas kernel, its gradient by the backward kernel."""
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
