"""Running the experts on their tokens: the grouped (sorted, ragged) matmul and the dense path.

Both compute, for each token, ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` with
``expert_e(x) = glu(x @ gate_e + b, x @ up_e + b) @ down_e + b``; they differ in cost only:

- ``grouped`` (the default): the ``T * k`` (token, expert) selections are sorted by expert, so each expert's
  rows are contiguous, and ``jax.lax.ragged_dot`` multiplies each group by its expert's matrix: the FLOPs of
  the active parameters only, no token ever dropped. ``jax.lax.ragged_dot`` rather than ``tokamax.ragged_dot``:
  it runs on every backend from jax itself (on CPU and GPU tokamax falls back to the same XLA op; on TPU XLA
  lowers it to its own grouped-matmul kernel), where tokamax would add four packages (qwix, jaxtyping, einshape,
  a pinned typeguard) to every install;
- ``dense``: every expert on every token, outputs weighted by a ``[T, E]`` combine matrix that is zero off the
  chosen experts: ``E / k`` times the FLOPs, one plain einsum, for tests and tiny expert counts.

A capacity (``capacity_factor``) keeps at most ``ceil(capacity_factor * T * k / E)`` selections per expert, the
first in token order; the others are dropped (their weight zeroed), as Switch Transformer and GShard do. The
expert axis of every stacked weight is the leading one, so it can be sharded (logical axis ``expert``).

Under a mesh with batch axes (``data``, ``fsdp``, ``expert``) :func:`run_experts` runs on each batch shard's
tokens alone (a ``shard_map`` over those axes, the expert weights gathered over ``fsdp`` as FSDP gathers every
weight): sorting the global batch's tokens would gather them all onto every device (Mixtral 8x7B on 128 v5p chips
planned 123 GiB of temporaries a chip that way). The capacity then counts each shard's tokens, as GShard's groups
do. With an ``expert`` axis the grouped dispatch keeps each device's ``E / mesh.expert`` experts and moves the
rows to them (:mod:`functrain.models.moe.expert_parallel`); the dense one gathers every expert (tests, tiny E).
"""

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from functrain.data.global_array import BATCH_AXES
from functrain.models.moe.expert_parallel import return_from_experts, send_to_experts

Array = jax.Array
Glu = Callable[[Array, Array], Array]  # (gate projection, up projection) -> the hidden activation


class ExpertWeights(NamedTuple):
    """The stacked weights of ``E`` experts (biases None where the family has none)."""

    gate: Array  # [E, hidden, inter]
    up: Array  # [E, hidden, inter]
    down: Array  # [E, inter, hidden]
    gate_bias: Array | None = None  # [E, inter]
    up_bias: Array | None = None  # [E, inter]
    down_bias: Array | None = None  # [E, hidden]


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """The selections each expert keeps: ``ceil(capacity_factor * tokens * top_k / num_experts)``."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def within_capacity(experts: Array, num_experts: int, limit: int) -> Array:
    """``[T, k]`` bool: whether each selection is among the first ``limit`` of its expert, counted in token
    order (token ``t``'s ``j``-th choice at flat position ``t * k + j``)."""
    flat = jnp.ravel(experts)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    sorted_rank = jnp.arange(flat.shape[0]) - starts[flat[order]]
    rank = jnp.zeros_like(sorted_rank).at[order].set(sorted_rank)
    return (rank < limit).reshape(experts.shape)


def _inverse(permutation: Array) -> Array:
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.shape[0], dtype=permutation.dtype))


def expert_mlp(rows: Array, group_sizes: Array, row_experts: Array, w: ExpertWeights, glu: Glu) -> Array:
    """``[N, hidden]`` outputs of ``rows`` [N, hidden] sorted by expert (``group_sizes`` [E] rows each, in order;
    rows past their sum come out as padding; ``row_experts`` [N]: each row's expert, for the biases)."""

    def project(inputs: Array, kernel: Array, bias: Array | None) -> Array:
        out = jax.lax.ragged_dot(inputs, kernel.astype(inputs.dtype), group_sizes)
        return out if bias is None else out + bias.astype(out.dtype)[row_experts]

    hidden = glu(project(rows, w.gate, w.gate_bias), project(rows, w.up, w.up_bias))
    return project(hidden, w.down, w.down_bias)


def grouped(
    x: Array,
    weights: Array,
    experts: Array,
    w: ExpertWeights,
    glu: Glu,
    expert_axis: str | None = None,
    limit: int | None = None,
) -> Array:
    """``[T, hidden]`` outputs through the sorted grouped matmul (``x`` [T, hidden], ``weights``/``experts``
    [T, k]); with ``expert_axis`` (inside a ``shard_map``), ``w`` holds this device's share of the experts and the
    rows travel to the devices holding theirs (:mod:`functrain.models.moe.expert_parallel`), at most ``limit``
    rows of each expert from each device when a capacity set one (dropped selections, marked with the expert id
    ``E``, stay home: weight 0)."""
    tokens, top_k = experts.shape
    local_experts = w.gate.shape[0]
    num_experts = local_experts * (1 if expert_axis is None else jax.lax.axis_size(expert_axis))
    flat = jnp.ravel(experts)
    order = jnp.argsort(flat, stable=True)  # selections grouped by expert, token order within a group
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[order // top_k]  # [T * k, hidden]
    if expert_axis is None:
        out = expert_mlp(rows, group_sizes, flat[order], w, glu)
    else:
        arrived, local_sizes, row_experts, route = send_to_experts(rows, group_sizes, local_experts, expert_axis, limit)
        out = return_from_experts(expert_mlp(arrived, local_sizes, row_experts, w, glu), route, expert_axis)
    out = out[_inverse(order)].reshape(tokens, top_k, -1)
    # Summed over a token's k experts in a fixed order: the result does not depend on the batch's sort.
    return jnp.einsum("tkh,tk->th", out, weights.astype(out.dtype))


def dense(x: Array, weights: Array, experts: Array, w: ExpertWeights, glu: Glu) -> Array:
    """``[T, hidden]`` outputs of every expert on every token, weighted by the routing (zero off the chosen)."""
    num_experts = w.gate.shape[0]

    def project(spec: str, inputs: Array, kernel: Array, bias: Array | None) -> Array:
        out = jnp.einsum(spec, inputs, kernel.astype(inputs.dtype))
        return out if bias is None else out + bias.astype(out.dtype)[:, None, :]

    hidden = glu(
        project("th,ehi->eti", x, w.gate, w.gate_bias), project("th,ehi->eti", x, w.up, w.up_bias)
    )  # [E, T, inter]
    out = project("eti,eih->eth", hidden, w.down, w.down_bias)
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(experts, num_experts, dtype=weights.dtype))
    return jnp.einsum("eth,te->th", out, combine.astype(out.dtype))


DISPATCH = {"grouped": grouped, "dense": dense}


EXPERT_AXIS = "expert"  # the mesh axis expert parallelism shards the experts' leading axis over


def _run_local(
    x: Array,
    weights: Array,
    experts: Array,
    real: Array,
    w: ExpertWeights,
    glu: Glu,
    dispatch: str,
    factor: float | None,
    expert_axis: str | None,
) -> tuple[Array, Array]:
    dropped = jnp.zeros_like(real)
    if factor is not None:
        tokens, top_k = experts.shape
        num_experts = w.gate.shape[0] * (1 if expert_axis is None else jax.lax.axis_size(expert_axis))
        limit = capacity(tokens, top_k, num_experts, factor)
        kept = within_capacity(experts, num_experts, limit)
        weights = jnp.where(kept, weights, 0.0)
        dropped = real * jnp.sum(~kept, axis=1)
    if expert_axis is not None:
        if factor is None:
            return grouped(x, weights, experts, w, glu, expert_axis), dropped
        # The dropped selections are not sent, so each device receives at most ``limit`` rows of each expert.
        sent = jnp.where(kept, experts, num_experts)
        return grouped(x, weights, sent, w, glu, expert_axis, limit), dropped
    return DISPATCH[dispatch](x, weights, experts, w, glu), dropped


def run_experts(
    x: Array,
    weights: Array,
    experts: Array,
    real: Array,
    w: ExpertWeights,
    glu: Glu,
    dispatch: str = "grouped",
    capacity_factor: float | None = None,
) -> tuple[Array, Array]:
    """``([T, hidden] outputs, [T] selections dropped per real token)``: the experts on ``x`` [T, hidden] by
    ``dispatch`` with the optional capacity (``real`` [T]: 1 on real tokens), on each batch shard's tokens
    alone under a mesh, the experts sharded over its ``expert`` axis (module docstring)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(axis for axis in BATCH_AXES if mesh.shape.get(axis, 1) > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[axis] for axis in axes):
        return _run_local(x, weights, experts, real, w, glu, dispatch, capacity_factor, None)
    # The grouped dispatch keeps each device's share of the experts; the dense one gathers them all.
    expert_axis = EXPERT_AXIS if EXPERT_AXIS in axes and dispatch == "grouped" else None
    local = functools.partial(_run_local, glu=glu, dispatch=dispatch, factor=capacity_factor, expert_axis=expert_axis)
    rows = PartitionSpec(axes)
    experts_spec = PartitionSpec(expert_axis)
    return jax.shard_map(
        local, in_specs=(rows, rows, rows, rows, experts_spec), out_specs=(rows, rows), axis_names=set(axes)
    )(x, weights, experts, real, w)
