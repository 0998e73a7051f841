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

Under a mesh with batch axes (``data``, ``fsdp``) :func:`run_experts` runs on each batch shard's tokens alone (a
``shard_map`` over those axes, the expert weights gathered as FSDP gathers every weight): sorting the global
batch's tokens would gather them all onto every device (Mixtral 8x7B on 128 v5p chips planned 123 GiB of
temporaries a chip that way). The capacity then counts each shard's tokens, as GShard's groups do.
"""

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from functrain.data.global_array import BATCH_AXES

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
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    sorted_rank = jnp.arange(flat.shape[0]) - starts[flat[order]]
    rank = jnp.zeros_like(sorted_rank).at[order].set(sorted_rank)
    return (rank < limit).reshape(experts.shape)


def _inverse(permutation: Array) -> Array:
    return jnp.zeros_like(permutation).at[permutation].set(jnp.arange(permutation.shape[0], dtype=permutation.dtype))


def grouped(x: Array, weights: Array, experts: Array, w: ExpertWeights, glu: Glu) -> Array:
    """``[T, hidden]`` outputs through the sorted grouped matmul (``x`` [T, hidden], ``weights``/``experts``
    [T, k])."""
    tokens, top_k = experts.shape
    num_experts = w.gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # selections grouped by expert, token order within a group
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    sorted_experts = flat[order]
    rows = x[order // top_k]  # [T * k, hidden]

    def project(inputs: Array, kernel: Array, bias: Array | None) -> Array:
        out = jax.lax.ragged_dot(inputs, kernel.astype(inputs.dtype), group_sizes)
        return out if bias is None else out + bias.astype(out.dtype)[sorted_experts]

    hidden = glu(project(rows, w.gate, w.gate_bias), project(rows, w.up, w.up_bias))
    out = project(hidden, w.down, w.down_bias)[_inverse(order)].reshape(tokens, top_k, -1)
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


def _run_local(
    x: Array,
    weights: Array,
    experts: Array,
    real: Array,
    w: ExpertWeights,
    glu: Glu,
    dispatch: str,
    factor: float | None,
) -> tuple[Array, Array]:
    dropped = jnp.zeros_like(real)
    if factor is not None:
        tokens, top_k = experts.shape
        kept = within_capacity(experts, w.gate.shape[0], capacity(tokens, top_k, w.gate.shape[0], factor))
        weights = jnp.where(kept, weights, 0.0)
        dropped = real * jnp.sum(~kept, axis=1)
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
    alone under a mesh (module docstring)."""
    local = functools.partial(_run_local, glu=glu, dispatch=dispatch, factor=capacity_factor)
    mesh = jax.sharding.get_abstract_mesh()
    axes = () if mesh.empty else tuple(axis for axis in BATCH_AXES if mesh.shape.get(axis, 1) > 1)
    if not axes or x.shape[0] % math.prod(mesh.shape[axis] for axis in axes):
        return local(x, weights, experts, real, w)
    rows = PartitionSpec(axes)
    return jax.shard_map(
        local, in_specs=(rows, rows, rows, rows, PartitionSpec()), out_specs=(rows, rows), axis_names=set(axes)
    )(x, weights, experts, real, w)
