"""Pipeline parallelism over the ``pipeline`` mesh axis: a scanned layer stack split into stages, micro-batched,
on a circular (interleaved) schedule.

The ``G`` stacked layer groups (:mod:`functrain.models.scan`) form ``stages x repeats`` chunks of
``L = G / (stages x repeats)`` consecutive groups; chunk ``k`` runs on stage ``k % stages``, so each stage holds
``repeats`` chunks that are not adjacent and a micro-batch passes through the stages ``repeats`` times
(``repeats=1`` is GPipe). The batch splits into ``M`` micro-batches; micro-batch ``m`` runs its repeat ``r`` on
stage ``s`` at iteration ``t = r * P + m + s`` with ``P = max(M, stages)``, so::

    iterations = (repeats - 1) * P + M + stages - 1      each stage busy repeats * M of them
    bubble     = 1 - repeats * M / iterations            = (stages - 1) / (repeats * M + stages - 1) when M >= stages

The loop is one ``lax.scan`` over iterations. Its carry is every stage's input ``[stages, micro-batch, ...]``
(sharded on ``pipeline``: each device computes its own stage, a ``vmap`` over stages whose constraints name the
axis, or a ``shard_map`` manual over that axis alone for a mixture of experts) and the micro-batches' activations
between passes; after each iteration the stages' outputs rotate one stage on (``jnp.roll``: XLA's
collective-permute). Micro-batches take every ``M``-th row, so each stays split over the data axes as the batch was.
What the groups return beside the hidden states (a mixture of experts' router statistics: sums over the rows) is
summed in the carry, each stage's ``[repeats, L, ...]``, on the iterations where the stage works on a real
micro-batch: the whole batch's sums, as the unpipelined scan returns them.

The parameters keep their logical layout ``[G, ...]`` (checkpoints restore onto any stage count); with
``repeats > 1`` the stage layout ``[stages, repeats, L, ...]`` is gathered from it inside the step (an all-to-all
of the layer weights over the axis each step; none for ``repeats=1``). The schedule is forward-then-backward over
all micro-batches (the backward pass is the scan's transpose), as in GPipe; 1F1B is not implemented
(docs/sharding-and-memory.md). Each iteration is checkpointed: the loop keeps only the stages' inputs of each
iteration ``[iterations, stages, micro-batch, ...]``, and the backward pass recomputes one iteration's stages at a
time (the blocks' inputs of one iteration live at once, under the model's remat), for one more forward pass of the
layers.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from functrain.data.global_array import BATCH_AXES

PIPELINE_AXIS = "pipeline"


@dataclass(frozen=True)
class PipelineSchedule:
    """How the stages run: ``repeats`` chunks per stage (``pipeline.repeats``) and ``microbatches`` per batch
    (``train.pipeline_microbatches``; None: as many as stages)."""

    repeats: int = 1
    microbatches: int | None = None


_SCHEDULE: contextvars.ContextVar[PipelineSchedule | None] = contextvars.ContextVar("pipeline_schedule", default=None)


@contextlib.contextmanager
def scheduled(schedule: PipelineSchedule) -> Iterator[None]:
    """Trace models under ``schedule`` (entered beside ``jax.set_mesh``; the stage count is the mesh's)."""
    token = _SCHEDULE.set(schedule)
    try:
        yield
    finally:
        _SCHEDULE.reset(token)


def current_schedule() -> PipelineSchedule:
    """The schedule :func:`scheduled` set (the defaults outside it)."""
    return _SCHEDULE.get() or PipelineSchedule()


def stage_count() -> int:
    """The ``pipeline`` axis size of the mesh being traced under (1 without a mesh or the axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or PIPELINE_AXIS not in mesh.axis_names else int(mesh.shape[PIPELINE_AXIS])


def microbatch_count(requested: int | None, stages: int, batch: int) -> int:
    """The micro-batches a batch of ``batch`` rows splits into: ``requested`` (None: ``stages``), lowered to a
    divisor of ``batch`` (an eval batch of another size); the config checks that training's divides."""
    return math.gcd(stages if requested is None else requested, batch)


def iterations(stages: int, repeats: int, microbatches: int) -> int:
    """The schedule's length (module docstring)."""
    return (repeats - 1) * max(microbatches, stages) + microbatches + stages - 1


def bubble_fraction(stages: int, repeats: int, microbatches: int) -> float:
    """The share of each stage's iterations spent idle: ``(stages - 1) / (repeats * M + stages - 1)`` when
    ``M >= stages`` (module docstring); 0 for one stage."""
    return 1.0 - repeats * microbatches / iterations(stages, repeats, microbatches)


def _constrain(x: jax.Array, *leading: Any) -> jax.Array:
    """Pin ``x``'s leading axes to ``leading`` mesh axes, the rest left to the compiler."""
    spec = [*leading, *[PartitionSpec.UNCONSTRAINED] * (x.ndim - len(leading))]
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def _batch_axes(rows: int) -> tuple[str, ...] | None:
    """The data axes a micro-batch of ``rows`` rows stays split over (None: it does not divide them)."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    return axes if axes and rows % math.prod(mesh.shape[axis] for axis in axes) == 0 else None


def _split_rows(x: jax.Array, microbatches: int) -> jax.Array:
    """``[B, ...] -> [M, B / M, ...]``, micro-batch ``m`` the rows ``m, m + M, ...``."""
    return jnp.swapaxes(x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]), 0, 1)


def _join_rows(x: jax.Array) -> jax.Array:
    """The inverse of :func:`_split_rows`."""
    return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def pipeline_layers(
    apply_group: Callable[[Any, jax.Array, tuple, jax.Array], tuple[jax.Array, Any]],
    stacked: Any,
    x: jax.Array,
    args: tuple,
    *,
    stages: int,
    schedule: PipelineSchedule,
    manual_stages: bool = False,
) -> tuple[jax.Array, Any]:
    """``x`` through the ``G`` groups of ``stacked`` (leaves ``[G, ...]``), pipelined over ``stages`` stages.

    ``apply_group(group_params, x, args, index) -> (x, output)`` applies one group (its leaves without the leading
    axis) to a micro-batch; ``index`` (int32) tells apart each group's call on each micro-batch (``group * M + m``:
    a key to fold into dropout's); ``args`` are per-row arrays ``[B, ...]`` (split with ``x``), arrays of one row
    ``[1, ...]`` (broadcast) or None. ``output`` is a tree of sums over the micro-batch's rows (a mixture of
    experts' router statistics; None for none). Returns what applying the groups in order to the whole batch
    gives: the hidden states and each group's outputs ``[G, ...]`` summed over the micro-batches (the whole
    batch's sums; module docstring). ``manual_stages``: each device runs its stage in a ``shard_map`` manual over
    the ``pipeline`` axis, for stages whose ops have no batched form (a mixture of experts' ``ragged_dot`` on TPU),
    rather than the ``vmap`` over the stages that batches every op (6% fewer temporaries on Llama 3 8B).
    """
    repeats = schedule.repeats
    groups = jax.tree.leaves(stacked)[0].shape[0]
    per_chunk = groups // (stages * repeats)
    batch = x.shape[0]
    count = microbatch_count(schedule.microbatches, stages, batch)
    period = max(count, stages)
    stage_axes = _batch_axes(batch // count)

    def stage_layout(leaf: jax.Array) -> jax.Array:  # [G, ...] -> [stages, repeats, L, ...]
        leaf = jnp.swapaxes(leaf.reshape(repeats, stages, per_chunk, *leaf.shape[1:]), 0, 1)
        return _constrain(leaf, PIPELINE_AXIS)

    def logical_layout(leaf: jax.Array) -> jax.Array:  # the inverse of stage_layout
        return jnp.swapaxes(leaf, 0, 1).reshape(groups, *leaf.shape[3:])

    def per_row(arg: Any) -> bool:
        return arg is not None and arg.shape[0] == batch

    params = jax.tree.map(stage_layout, stacked)
    split_args = tuple(_split_rows(arg, count) if per_row(arg) else arg for arg in args)
    activations = _split_rows(x, count)
    if stage_axes:
        activations = _constrain(activations, None, stage_axes)

    def run_stage(chunks: Any, h: jax.Array, stage: jax.Array, repeat: jax.Array, micro: jax.Array) -> Any:
        # [L, ...]: this stage's groups this repeat (recomputed in the backward pass, like the rest of the iteration).
        chunk = jax.tree.map(lambda leaf: leaf[0] if repeats == 1 else leaf[repeat], chunks)
        stage_args = tuple(arg[micro] if per_row(original) else arg for arg, original in zip(split_args, args))
        first_group = (repeat * stages + stage) * per_chunk

        def one_group(h: jax.Array, group: tuple[Any, jax.Array]) -> tuple[jax.Array, Any]:
            group_params, position = group
            return apply_group(group_params, h, stage_args, (first_group + position) * count + micro)

        return jax.lax.scan(one_group, h, (chunk, jnp.arange(per_chunk)))  # (h, outputs [L, ...])

    stage_ids = jnp.arange(stages)

    # Each iteration keeps only its inputs for the backward pass, which recomputes the stages' forward pass one
    # iteration at a time: else the transpose of the loop keeps every iteration's residuals of every layer of the
    # stage (its blocks' inputs under remat), stacked over the iterations.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def run_stages(params: Any, inputs: jax.Array, repeat: jax.Array, micro: jax.Array) -> Any:
        if not manual_stages:
            return jax.vmap(run_stage, spmd_axis_name=PIPELINE_AXIS)(params, inputs, stage_ids, repeat, micro)

        def own_stage(*stage_args: Any) -> Any:  # each device's stage, its leading axis of 1
            return jax.tree.map(lambda leaf: leaf[None], run_stage(*jax.tree.map(lambda leaf: leaf[0], stage_args)))

        # Manual over the stages only (the other axes stay automatic inside). Unchecked varying types: with the
        # check, Shardy rejects the experts' own shard_map over the batch axes inside.
        stage = PartitionSpec(PIPELINE_AXIS)
        return jax.shard_map(own_stage, in_specs=stage, out_specs=stage, axis_names={PIPELINE_AXIS}, check_vma=False)(
            params, inputs, stage_ids, repeat, micro
        )

    def add_output(total: Any, repeat: jax.Array, busy: jax.Array, output: Any) -> Any:
        # One stage's sums [repeats, L, ...] plus its groups' outputs on the micro-batch it worked on, if any.
        return jax.tree.map(lambda t, o: t.at[repeat].add(jnp.where(busy, o, jnp.zeros_like(o))), total, output)

    def iteration(
        carry: tuple[jax.Array, jax.Array, Any], t: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array, Any], None]:
        inputs, activations, totals = carry
        inputs = inputs.at[0].set(activations[jnp.minimum(t % period, count - 1)])
        if stage_axes:
            inputs = _constrain(inputs, PIPELINE_AXIS, stage_axes)
        offset = t - stage_ids  # where each stage is in its own schedule; idle stages compute on stale rows
        repeat = jnp.clip(offset // period, 0, repeats - 1)
        micro = jnp.clip(offset % period, 0, count - 1)
        busy = (offset >= 0) & (offset // period < repeats) & (offset % period < count)
        outputs, group_outputs = run_stages(params, inputs, repeat, micro)
        totals = jax.vmap(add_output, spmd_axis_name=PIPELINE_AXIS)(totals, repeat, busy, group_outputs)
        slot = micro[-1]
        activations = activations.at[slot].set(jnp.where(busy[-1], outputs[-1], activations[slot]))
        return (jnp.roll(outputs, 1, axis=0), activations, totals), None

    inputs = jnp.zeros((stages, *activations.shape[1:]), x.dtype)
    first = jnp.zeros((stages,), jnp.int32)
    shapes = jax.eval_shape(run_stages, params, inputs, first, first)[1]  # [stages, L, ...]
    totals = jax.tree.map(
        lambda s: _constrain(jnp.zeros((stages, repeats, *s.shape[1:]), s.dtype), PIPELINE_AXIS), shapes
    )
    (_, activations, totals), _ = jax.lax.scan(
        iteration, (inputs, activations, totals), jnp.arange(iterations(stages, repeats, count))
    )
    return _join_rows(activations), jax.tree.map(logical_layout, totals)
