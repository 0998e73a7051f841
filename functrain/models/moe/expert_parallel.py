"""Expert parallelism: the experts sharded over the ``expert`` mesh axis, each token's rows sent to the devices
that hold its experts and their outputs sent back (inside the ``shard_map`` of
:func:`functrain.models.moe.dispatch.run_experts`, where ``expert`` also splits the batch).

Each device sorts its ``N = T * k`` (token, expert) rows by expert, so the rows for device ``d`` (experts
``d * E_local .. (d + 1) * E_local - 1``) are one contiguous slice. One all-gather of the ``[E]`` group sizes gives
every device the whole ``[source, destination, local expert]`` traffic table, from which each side computes the
offsets and sizes of a ragged all-to-all; the receiver sorts what arrived (grouped by source, then by expert) by
its local expert, runs the grouped matmul, unsorts, and a second ragged all-to-all with the offsets swapped
returns every row to the slot it left. Dropless: a device's receive buffer holds ``ep * N`` rows, what it would
get if every device sent it every row (MaxText sizes its buffer the same way). With a capacity factor each device
keeps at most ``C`` rows of each expert and sends no dropped one, so ``ep * E_local * C`` rows (about
``capacity_factor * N``) suffice.

The transfer is ``jax.lax.ragged_all_to_all`` on TPU and GPU. XLA:CPU does not implement it, so on CPU
:func:`gathered_all_to_all` computes the same result from all-gathers: every offset and size the TPU's collective
is given is then the one the CPU tests check, and only the collective itself differs (its ``ep``-fold buffer is
no cost at the sizes CPUs run).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from functrain.parallel.target import target_platform

Array = jax.Array


class Route(NamedTuple):
    """Where a device's rows went, to bring their outputs back (sizes and offsets ``[ep]`` int32)."""

    sent: Array  # rows this device sent each device
    received: Array  # rows each device sent this one
    received_at: Array  # where each source's rows start in this device's receive buffer
    returned_to: Array  # where this device's rows from each source go back to in that source's sorted rows
    order: Array  # the sort of the receive buffer by local expert
    rows: int  # N, the rows each device sorted


def _exclusive_cumsum(sizes: Array, axis: int = 0) -> Array:
    return jnp.cumsum(sizes, axis=axis) - sizes


def gathered_all_to_all(
    operand: Array,
    output: Array,
    input_offsets: Array,
    send_sizes: Array,
    output_offsets: Array,
    recv_sizes: Array,
    *,
    axis_name: str,
) -> Array:
    """``jax.lax.ragged_all_to_all``'s result built from all-gathers, for XLA:CPU (which lacks the collective):
    every device gathers every operand and the slices meant for it, and writes them where their senders said."""
    del recv_sizes  # the gathered send sizes say the same
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [ep, N, ...]
    # Column ``me`` of each source's offsets and sizes: the slices meant for this device.
    starts, sizes, lands = (
        jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
    )
    position = jnp.arange(output.shape[0])[:, None]
    inside = (position >= lands) & (position < lands + sizes)  # [M, ep]: which source writes each output row
    source = jnp.argmax(inside, axis=1)
    row = jnp.clip(starts[source] + position[:, 0] - lands[source], 0, operand.shape[0] - 1)
    written = jnp.any(inside, axis=1).reshape((-1,) + (1,) * (operand.ndim - 1))
    return jnp.where(written, operands[source, row], output)


def _transfer(target: str) -> Callable[..., Array]:
    return jax.lax.ragged_all_to_all if target in ("tpu", "gpu") else gathered_all_to_all


def send_to_experts(
    rows: Array, group_sizes: Array, local_experts: int, axis: str, limit: int | None = None
) -> tuple[Array, Array, Array, Route]:
    """Send ``rows`` [N, hidden] sorted by global expert (``group_sizes`` [E]; rows past their sum stay home) to
    the devices along ``axis`` that hold their experts; returns ``(received rows sorted by local expert [B,
    hidden], local group sizes [E_local], each received row's local expert (clipped), route back)``, rows past the
    group sizes padding. ``B = ep * N``, or ``ep * E_local * limit`` when no device sends more than ``limit`` rows
    of an expert (a capacity)."""
    ep, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    table = jax.lax.all_gather(group_sizes, axis).reshape(ep, ep, local_experts)  # [source, destination, expert]
    traffic = table.sum(-1)  # [source, destination]
    sent, received = traffic[me], traffic[:, me]
    left_from, lands = _exclusive_cumsum(sent), _exclusive_cumsum(traffic, axis=0)[me]
    received_at, returned_to = _exclusive_cumsum(received), _exclusive_cumsum(traffic, axis=1)[:, me]
    per_source = rows.shape[0] if limit is None else min(rows.shape[0], local_experts * limit)
    buffer = jnp.zeros((ep * per_source,) + rows.shape[1:], rows.dtype)
    arrived = _transfer(target_platform())(rows, buffer, left_from, sent, lands, received, axis_name=axis)
    # Arrived grouped by source, then by local expert: label each row (padding: ``local_experts``), then sort.
    counts = table[:, me, :]  # [source, local expert]
    labels = jnp.concatenate([jnp.tile(jnp.arange(local_experts), ep), jnp.array([local_experts])])
    repeats = jnp.concatenate([counts.reshape(-1), (buffer.shape[0] - counts.sum()).reshape(1)])
    row_experts = jnp.repeat(labels, repeats, total_repeat_length=buffer.shape[0])
    order = jnp.argsort(row_experts, stable=True)
    route = Route(sent, received, received_at, returned_to, order, rows.shape[0])
    # The padding's label clipped to a real expert: its rows are never sent back, but a bias is looked up for them.
    return arrived[order], counts.sum(0), jnp.minimum(row_experts[order], local_experts - 1), route


def return_from_experts(outputs: Array, route: Route, axis: str) -> Array:
    """The received rows' ``outputs`` (in :func:`send_to_experts`' local order) back on the devices that sent
    them, each in the slot its row left: ``[N, hidden]`` sorted by global expert, as the rows were."""
    unsorted = jnp.zeros_like(outputs).at[route.order].set(outputs)  # grouped by source again
    home = jnp.zeros((route.rows,) + outputs.shape[1:], outputs.dtype)
    return _transfer(target_platform())(
        unsorted, home, route.received_at, route.received, route.returned_to, route.sent, axis_name=axis
    )
