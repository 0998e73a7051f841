"""Pure train and eval steps.

``loss_fn(params, batch, rng) -> (loss_sum, weight_sum, aux)`` returns *sums*: the loss summed over real
tokens/examples, the number (or total weight) of them, and a dict of further scalar sums. The step divides
once, by the total weight of all micro-batches of the global batch, so accumulation over micro-batches and
devices is exact (never a mean of means). Under ``jit`` with a batch sharded over devices the sums are
global sums: XLA inserts the cross-device reductions.

A model with mutable collections passes ``stateful=True``; its loss function is then
``loss_fn(params, model_state, batch, rng) -> (loss_sum, weight_sum, aux, new_model_state)``.

A loss that needs sums over the whole global batch before any gradient (an MoE balanced over the global batch:
:mod:`functrain.core.model_output`) comes with ``batch_totals(params, model_state, micro_batch, rng) -> sums``
(None: none needed, known from its shapes when the step is traced): with several micro-batches the step first runs
it forward-only over each and passes the total to every micro-batch's loss as ``loss_fn(..., totals=total)``; with
one, the loss's own forward holds them already.
"""

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from functrain.core.precision import cast_floating, cast_like, update_loss_scale
from functrain.core.state import TrainState

Batch = dict[str, jax.Array]
# Evaluation uses one fixed key, distinct from every training step key (steps are < 2**31).
EVAL_KEY_DATA = 2**32 - 1
Metrics = dict[str, jax.Array]


@dataclass(frozen=True)
class StepSettings:
    """What a backend's step is made with, as both backends read it (the builder fills it from ``train.*``)."""

    micro_batches: int = 1
    clip_norm: float | None = None
    compute_dtype: str = "float32"  # the forward/backward pass
    matmul_precision: str = "auto"  # its products' (functrain.core.precision.matmul_precision)
    param_dtype: str = "float32"  # the stored (master) weights
    fp8: bool = False  # the projections as FP8 products (functrain.core.fp8)
    dynamic_loss_scale: bool = False
    offload_optimizer: bool = False  # optimizer state in pinned host memory (GPU/TPU)


def split_micro_batches(batch: Batch, micro_batches: int) -> Batch:
    """Split every leaf ``[B, ...]`` into ``[micro_batches, B // micro_batches, ...]``.

    Micro-batch ``m`` takes rows ``m, m + M, m + 2M, ...``: with the batch sharded in contiguous blocks over
    devices, every device then holds its own share of every micro-batch and no data moves between devices.
    """

    def split(x):
        rows = x.shape[0]
        return x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def _as_stateful(loss_fn: Callable, stateful: bool) -> Callable:
    """Present every loss function as the stateful form, so the step has one code path."""
    if stateful:
        return loss_fn

    def stateful_loss(params, model_state, batch, rng):
        loss_sum, weight, aux = loss_fn(params, batch, rng)
        return loss_sum, weight, aux, model_state

    return stateful_loss


def _global_totals(
    batch_totals: Callable, params: Any, model_state: Any, batch: Batch, rng: jax.Array, micro_batches: int
) -> Any:
    """``batch_totals`` summed over the micro-batches of one batch (forward only; keys as the gradient pass's)."""
    micro = split_micro_batches(batch, micro_batches)

    def add(total, inputs):
        index, micro_batch = inputs
        sums = batch_totals(params, model_state, micro_batch, jax.random.fold_in(rng, index))
        return jax.tree.map(jnp.add, total, sums), None

    first = jax.tree.map(lambda x: x[0], micro)
    shapes = jax.eval_shape(batch_totals, params, model_state, first, rng)
    if shapes is None:  # the model's terms need no global sums (or it has none): no forward-only pass
        return None
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return jax.lax.scan(add, zeros, (jnp.arange(micro_batches), micro))[0]


def _gradient_sums(
    loss_fn: Callable,
    params: Any,
    model_state: Any,
    batch: Batch,
    rng: jax.Array,
    micro_batches: int,
    compute_dtype: Any,
    loss_scale: jax.Array,
    totals: Any = None,
):
    """Sum of (scaled) gradients, loss, weight and aux over the micro-batches of one batch (each micro-batch's
    loss given the global ``totals`` when not None)."""
    given = {} if totals is None else {"totals": totals}

    def scaled_loss(p, ms, micro_batch, key):
        loss_sum, weight, aux, new_ms = loss_fn(cast_floating(p, compute_dtype), ms, micro_batch, key, **given)
        loss_sum = loss_sum.astype(jnp.float32)
        return loss_sum * loss_scale, (loss_sum, jnp.asarray(weight, jnp.float32), aux, new_ms)

    grad_fn = jax.grad(scaled_loss, has_aux=True)
    if micro_batches == 1:
        grads, (loss_sum, weight, aux, model_state) = grad_fn(params, model_state, batch, rng)
        return grads, loss_sum, weight, aux, model_state

    micro = split_micro_batches(batch, micro_batches)

    def accumulate(carry, inputs):
        index, micro_batch = inputs
        grad_acc, loss_acc, weight_acc, aux_acc, ms = carry
        grads, (loss_sum, weight, aux, ms) = grad_fn(params, ms, micro_batch, jax.random.fold_in(rng, index))
        add = lambda a, b: a + b.astype(a.dtype)  # noqa: E731
        return (
            jax.tree.map(add, grad_acc, grads),
            loss_acc + loss_sum,
            weight_acc + weight,
            jax.tree.map(add, aux_acc, aux),
            ms,
        ), None

    first = jax.tree.map(lambda x: x[0], micro)
    aux_shape = jax.eval_shape(lambda: scaled_loss(params, model_state, first, rng)[1][2])
    zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), tree)  # noqa: E731
    init = (zeros(params), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros(aux_shape), model_state)
    (grads, loss_sum, weight, aux, model_state), _ = jax.lax.scan(accumulate, init, (jnp.arange(micro_batches), micro))
    return grads, loss_sum, weight, aux, model_state


def select(tree: Any, mask: Any, keep: bool = True) -> Any:
    """``tree`` with the leaves where ``mask`` is not ``keep`` replaced by None (an empty subtree)."""
    return jax.tree.map(lambda m, x: x if m == keep else None, mask, tree)


def combine(mask: Any, trained: Any, frozen: Any) -> Any:
    """The full tree from its two `select` halves."""
    return jax.tree.map(lambda m, a, b: a if m else b, mask, trained, frozen, is_leaf=lambda x: x is None)


def trainable_only(tx: optax.GradientTransformation, trainable: Any) -> optax.GradientTransformation:
    """``tx`` keeping state for the ``trainable`` leaves only; its updates take and give those leaves only
    (the `select`-ed tree), as `make_train_step` with ``trainable`` passes them."""

    def init(params):
        return tx.init(select(params, trainable))

    def update(updates, state, params=None):
        return tx.update(updates, state, None if params is None else select(params, trainable))

    return optax.GradientTransformation(init, update)


def _clip_by_global_norm(grads: Any, grad_norm: jax.Array, clip_norm: float) -> Any:
    """optax.clip_by_global_norm's rule, reusing the norm the step already computed."""
    scale = jnp.where(grad_norm < clip_norm, 1.0, clip_norm / grad_norm)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    *,
    micro_batches: int = 1,
    clip_norm: float | None = None,
    compute_dtype: Any = None,
    dynamic_loss_scale: bool = False,
    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None,
    stateful: bool = False,
    trainable: Any = None,
    batch_totals: Callable | None = None,
    end_of_step: Callable[[Any, Any], tuple[Any, Any]] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build the pure ``train_step(state, batch) -> (state, metrics)``.

    Args:
      loss_fn: ``(params, batch, rng) -> (loss_sum, weight_sum, aux_sums)`` (see the module docstring).
      tx: the optax optimizer.
      micro_batches: gradient accumulation inside the step; the batch's leading size must divide by it.
      clip_norm: global-norm clipping threshold, or None.
      compute_dtype: dtype the parameters are cast to for the forward/backward pass (the stored parameters
        keep their own dtype; gradients are reduced and clipped in float32, then cast to it for the update).
      dynamic_loss_scale: scale the loss for float16 compute, halving the scale on overflow.
      learning_rate_fn: the schedule, reported as the ``learning_rate`` metric (None: no such metric).
      stateful: ``loss_fn`` takes and returns ``model_state`` (see the module docstring).
      trainable: a tree of bools shaped like the params: only those leaves are differentiated and updated,
        the others stay frozen (LoRA); ``tx`` must then be wrapped with `trainable_only`. None: all train.
      batch_totals: the global sums the (stateful-form) loss needs first, see the module docstring; None: none.
      end_of_step: ``(params, model_state) -> (params, model_state)`` run once after each applied update, on the
        whole params (frozen leaves included) and the model state the step's micro-batches left (DeepSeek's bias
        update from the selections they counted); not run on a skipped update.

    A non-finite loss or gradient never reaches the parameters: that update is skipped (params, optimizer
    and model state stay as they were), counted in ``skipped_steps`` and flagged by the ``nonfinite``
    metric, on which the caller may stop (the loop does with ``train.nonfinite: stop``).

    Metrics: ``loss`` (mean over the total weight), ``weight`` (tokens or examples), ``grad_norm`` (before
    clipping), ``learning_rate`` (with ``learning_rate_fn``), ``skipped_steps``, ``nonfinite`` (this step),
    ``nonfinite_steps`` (all steps so far), ``loss_scale`` when dynamic, and every aux sum divided by the total weight.
    """
    full_loss = _as_stateful(loss_fn, stateful)

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        scale = state.loss_scale if dynamic_loss_scale else jnp.ones((), jnp.float32)
        if trainable is None:
            params, loss, frozen = state.params, full_loss, None
        else:
            # Differentiate the trainable leaves only: the frozen ones enter as constants, so XLA never
            # computes their gradients and the optimizer never sees them.
            params, frozen = select(state.params, trainable), select(state.params, trainable, False)
            frozen_compute = cast_floating(frozen, compute_dtype)

            def loss(p, ms, b, key, **totals):
                return full_loss(combine(trainable, p, frozen_compute), ms, b, key, **totals)

        totals = None
        if batch_totals is not None and micro_batches > 1:
            all_params = cast_floating(state.params, compute_dtype)
            totals = _global_totals(batch_totals, all_params, state.model_state, batch, state.step_key(), micro_batches)
        grad_sums, loss_sum, weight, aux, new_model_state = _gradient_sums(
            loss, params, state.model_state, batch, state.step_key(), micro_batches, compute_dtype, scale, totals
        )
        # One division by the global weight; max() keeps an all-padding batch from dividing by zero.
        denominator = jnp.maximum(weight, 1e-12)
        grads = jax.tree.map(lambda g: g / (scale * denominator), grad_sums)
        loss = loss_sum / denominator
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if clip_norm is not None:
            grads = _clip_by_global_norm(grads, grad_norm, clip_norm)

        def apply_update(operands):
            grads, opt_state, params, all_params = operands
            updates, opt_state = tx.update(grads, opt_state, all_params)
            return optax.apply_updates(params, updates), opt_state

        # A skipped update hands the old params and optimizer state back untouched. Under lax.cond the applied
        # update runs in place; a select between the new and old trees kept both alive (copies that cost a
        # small model's step about 1.5%). The optimizer sees gradients in the parameters' dtype, so its state
        # keeps its dtypes step after step.
        new_params, new_opt_state = jax.lax.cond(
            finite,
            apply_update,
            lambda operands: (operands[2], operands[1]),
            (cast_like(grads, params), state.opt_state, params, state.params),
        )
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        if trainable is not None:
            new_params = combine(trainable, new_params, frozen)
        if end_of_step is not None:
            new_params, new_model_state = jax.lax.cond(
                finite, lambda pair: end_of_step(*pair), lambda pair: pair, (new_params, new_model_state)
            )

        if dynamic_loss_scale:
            loss_scale, good_steps = update_loss_scale(state.loss_scale, state.good_steps, finite)
        else:
            loss_scale, good_steps = state.loss_scale, state.good_steps
        skipped = state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32)
        # With dynamic scaling an overflow is routine; only a non-finite loss is an incident.
        nonfinite = (~jnp.isfinite(loss) if dynamic_loss_scale else ~finite).astype(jnp.int32)
        nonfinite_steps = state.nonfinite_steps + nonfinite
        new_state = state.replace(
            step=state.step + 1,
            params=new_params,
            opt_state=new_opt_state,
            model_state=keep(new_model_state, state.model_state),
            loss_scale=loss_scale,
            good_steps=good_steps,
            skipped_steps=skipped,
            nonfinite_steps=nonfinite_steps,
        )

        applied_updates = state.step - state.skipped_steps
        metrics = {
            "loss": loss,
            "weight": weight,
            "grad_norm": grad_norm,
            "skipped_steps": skipped,
            "nonfinite": nonfinite,
            "nonfinite_steps": nonfinite_steps,
        }
        if learning_rate_fn is not None:
            metrics["learning_rate"] = learning_rate_fn(applied_updates)
        if dynamic_loss_scale:
            metrics["loss_scale"] = state.loss_scale
        metrics.update({name: value / denominator for name, value in aux.items()})
        return new_state, metrics

    return train_step


def make_train_call(train_step: Callable) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Run ``K`` steps in one call: ``batches`` leaves are ``[K, ...]``, metrics come back ``[K]``.

    One compiled call per ``K`` steps removes the per-step dispatch cost that dominates small models.
    """

    def train_call(state: TrainState, batches: Batch) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(train_step, state, batches)

    return train_call


def make_eval_step(
    loss_fn: Callable, *, compute_dtype: Any = None, stateful: bool = False
) -> Callable[[TrainState, Batch], Metrics]:
    """Build the pure ``eval_step(state, batch) -> sums``: ``loss`` and aux as sums, and ``weight``.

    Sums (not means) so the loop can add them over batches and divide once by the total weight.
    """
    full_loss = _as_stateful(loss_fn, stateful)

    def eval_step(state: TrainState, batch: Batch) -> Metrics:
        params = cast_floating(state.params, compute_dtype)
        eval_rng = jax.random.fold_in(state.rng, EVAL_KEY_DATA)
        loss_sum, weight, aux, _ = full_loss(params, state.model_state, batch, eval_rng)
        sums = {"loss": loss_sum.astype(jnp.float32), "weight": jnp.asarray(weight, jnp.float32)}
        sums.update({name: value.astype(jnp.float32) for name, value in aux.items()})
        return sums

    return eval_step
