"""A Program: what the JAX backend needs from a model and a task's loss; and :func:`task_program`, the one function
that assembles every task's.

    Program(init, loss_fn, eval_loss_fn, logical_specs, trainable=None, complete_params=None, state_for_params=None,
            state_logical_specs=None, batch_totals=None, end_of_step=None)
      loss_fn(params, model_state, batch, rng) -> (loss_sum, weight, aux_sums, model_state)   # training mode
      eval_loss_fn(...)                                            # the same in evaluation mode
      state_for_params(params, model_state) -> model_state: the model state of a run starting from ``params``
        that come without one (a converted model): a task's entries seeded from the starting weights (a
        preference run's frozen reference copy); None: ``init``'s model state
      state_logical_specs() -> {entry: tree of PartitionSpec}: model-state entries sharded by logical axes of
        their own under the mesh rules (a distillation teacher's weights); None: every model-state leaf takes the
        sharding of a param with its path suffix and shape, else is replicated
      batch_totals(params, model_state, batch, rng) -> tree of sums: what the loss needs summed over the whole
        global batch before any micro-batch's gradient (an MoE's expert counts under global-batch balancing,
        :mod:`functrain.core.model_output`); the step runs it forward-only over every micro-batch and passes the
        total as ``loss_fn(..., totals=...)``; None: the loss needs none
      trainable, complete_params, end_of_step: the model's pieces' (:mod:`functrain.core.adapters`)

One assembly path. A task writes a :class:`TaskLoss`: what its trained forward reads of a batch, and its sums on
that forward's logits (it may run frozen forwards of its own: a reference, a teacher). :func:`task_program` runs the
forward, adds the model's training terms scaled by the task's weight, passes the global batch's totals when the
terms want them, keeps the task's model-state entries out of the model's forward, and keeps the pieces'
``trainable``, ``complete_params`` and ``end_of_step``: every task gets the model's terms and updates by
construction, since it never sees them. The supervised tasks' built-in losses are task losses like any other
(:func:`builtin_task_loss`); a user's ``loss_fn`` is the user's whole loss (:func:`user_program`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from functrain.core.adapters import (
    Apply,
    Batch,
    ModelPieces,
    init_shapes,
    model_inputs_of,
    model_kind_of,
    model_pieces,
)
from functrain.core.fields import Fields, canonical, require_builtin, resolve_fields
from functrain.core.losses import JAX_OPS, LOSSES, model_inputs, model_keywords
from functrain.core.model_output import ModelOutput, add_terms
from functrain.core.unembedding import LogitsChunk
from functrain.core.user_loss import check_user_loss, check_weight_is_a_count, user_loss
from functrain.errors import ConfigError

__all__ = [
    "LossContext",
    "Program",
    "TaskLoss",
    "TaskState",
    "as_program",
    "builtin_program",
    "builtin_task_loss",
    "check_logits",
    "task_program",
    "user_program",
]


@dataclass(frozen=True)
class Program:
    """The pure pieces of one model and loss (see the module docstring)."""

    init: Callable[[jax.Array], tuple[Any, Any]]
    loss_fn: Callable
    eval_loss_fn: Callable
    logical_specs: Callable[[], Any]
    trainable: Callable[[Any], Any] | None = None
    complete_params: Callable[[Any, jax.Array], Any] | None = None
    state_for_params: Callable[[Any, Any], Any] | None = None
    state_logical_specs: Callable[[], dict[str, Any]] | None = None
    batch_totals: Callable | None = None
    end_of_step: Callable[[Any, Any], tuple[Any, Any]] | None = None


class LossContext(NamedTuple):
    """What a task's sums may read beside the logits: the step's ``params`` and whole ``model_state`` (with the
    task's own entries: a reference copy, a teacher's weights), its ``rng`` and whether it ``train``\\ s."""

    params: Any
    model_state: Any
    rng: jax.Array
    train: bool


@dataclass(frozen=True)
class TaskState:
    """Model-state entries a task keeps beside the model's (a frozen reference copy, a teacher's weights): never
    seen by the model's forward, carried through every step unchanged, sharded and checkpointed with the state.

    Attributes:
      names: the entries' names.
      entries: ``entries(params) -> {name: tree}``: their value at a fresh start with these starting params.
      from_params: a run starting from params without a model state (a converted checkpoint) sets them from those
        params (a reference copy); False: from ``init`` (a teacher, loaded by a start hook).
      logical_specs: ``() -> {name: tree of PartitionSpec}``, or None: sharded like params of the same path and
        shape.
    """

    names: tuple[str, ...]
    entries: Callable[[Any], dict[str, Any]]
    from_params: bool = False
    logical_specs: Callable[[], dict[str, Any]] | None = None

    def outside(self, model_state: Any) -> Any:
        """``model_state`` without the task's entries: the model's own."""
        return {name: value for name, value in model_state.items() if name not in self.names}


@dataclass(frozen=True)
class TaskLoss:
    """A task's loss on the model's trained forward (see the module docstring).

    Attributes:
      inputs: ``inputs(batch) -> (model inputs, keywords)``: what the trained forward runs on.
      sums: ``sums(scores, batch, context) -> (loss_sum, weight, aux_sums)``: sums, never means (the step divides
        once by the whole batch's weight), on ``scores``: the forward's logits, or what ``score`` made of them;
        ``context`` a :class:`LossContext`.
      score: ``score(logits, batch) -> tree``: what ``sums`` reads of the logits, computed with the forward (inside
        its rematerialisation); None: the logits themselves.
      remat: the forward and ``score`` rematerialised: nothing kept for the backward, which runs them again, so XLA
        compiles the forward as a frozen reference's plain forward (equal weights give bitwise equal log-probs).
      forward: a forward replacing the pieces' ``apply`` (same signature; GRPO's shared prompt prefix), or None.
      state: the task's own model-state entries, or None.
    """

    inputs: Callable[[Batch], tuple[Any, dict[str, Any]]]
    sums: Callable[[Any, Batch, LossContext], tuple[Any, Any, dict]]
    score: Callable[[Any, Batch], Any] | None = None
    remat: bool = False
    forward: Apply | None = None
    state: TaskState | None = None


def _on_pieces(pieces: ModelPieces, loss_fn: Callable, eval_loss_fn: Callable, **task_parts: Any) -> Program:
    """The Program of a loss on ``pieces``, keeping what the model and its transforms declared."""
    return Program(
        task_parts.pop("init", pieces.init),
        loss_fn,
        eval_loss_fn,
        pieces.logical_specs,
        trainable=pieces.trainable,
        complete_params=pieces.complete_params,
        end_of_step=pieces.end_of_step,
        **task_parts,
    )


def _trained_forward(pieces: ModelPieces, task: TaskLoss) -> Callable:
    """``forward(params, model_state, batch, train, rng) -> (scores, terms, new model state)``: the task's trained
    forward on the model's own state, the task's entries carried around it."""
    apply = task.forward or pieces.apply
    state = task.state

    def forward(params: Any, model_state: Any, batch: Batch, train: bool, rng: jax.Array) -> tuple[Any, Any, Any]:
        inputs, keywords = task.inputs(batch)

        def scored(params: Any, own: Any) -> tuple[Any, Any, Any]:
            output = apply(params, own, inputs, train, rng, **keywords)
            scores = output.logits if task.score is None else task.score(output.logits, batch)
            return scores, output.terms, output.state

        own = model_state if state is None else state.outside(model_state)
        scores, terms, new_state = (jax.checkpoint(scored) if task.remat else scored)(params, own)
        if state is not None:
            new_state = {**new_state, **{name: model_state[name] for name in state.names}}
        return scores, terms, new_state

    return forward


def task_program(pieces: ModelPieces, task: TaskLoss) -> Program:
    """The Program of ``task`` on the model's ``pieces``: the one way a task's loss becomes a Program (module
    docstring)."""
    forward, state = _trained_forward(pieces, task), task.state

    def loss(train: bool) -> Callable:
        def loss_fn(params: Any, model_state: Any, batch: Batch, rng: jax.Array, totals: Any = None):
            scores, terms, new_state = forward(params, model_state, batch, train, rng)
            loss_sum, weight, aux = task.sums(scores, batch, LossContext(params, model_state, rng, train))
            loss_sum, aux = add_terms(terms, loss_sum, weight, aux, totals)
            return loss_sum, weight, aux, new_state

        return loss_fn

    def batch_totals(params: Any, model_state: Any, batch: Batch, rng: jax.Array) -> Any:
        # None (seen from the shapes as the step is traced) where the model's terms need no global sums. Else only
        # the terms' sums and the task's weight are used: XLA drops the rest of the sums (a reference's forward).
        scores, terms, _ = forward(params, model_state, batch, True, rng)
        if terms is None or not terms.wants_batch_totals:
            return None
        weight = task.sums(scores, batch, LossContext(params, model_state, rng, True))[1]
        return terms.batch_totals(weight)

    def init(rng: jax.Array) -> tuple[Any, Any]:
        params, model_state = pieces.init(rng)
        return params, model_state if state is None else {**model_state, **state.entries(params)}

    def state_for_params(params: Any, model_state: Any) -> Any:
        assert state is not None
        return {**state.outside(model_state), **state.entries(params)}

    return _on_pieces(
        pieces,
        loss(True),
        loss(False),
        init=pieces.init if state is None else init,  # the model's own: its shapes are known once traced
        state_for_params=state_for_params if state is not None and state.from_params else None,
        state_logical_specs=None if state is None else state.logical_specs,
        batch_totals=batch_totals,
    )


# ------------------------------------------------------------------------------------- supervised and user losses


def builtin_task_loss(kind: str, fields: Fields | None = None, logits_chunk: LogitsChunk = "off") -> TaskLoss:
    """The built-in loss of ``kind`` (:data:`functrain.core.losses.LOSSES`) as a task loss; ``fields``: the batch's
    roles when its names are not the loss's own (see :func:`functrain.core.fields.canonical`); ``logits_chunk``: a
    causal LM's cross-entropy over chunks of positions (:mod:`functrain.core.unembedding`; a model that does not
    take the setting gives its logits)."""

    def named(batch: Batch) -> Batch:
        return batch if fields is None else canonical(fields, batch)

    def inputs(batch: Batch) -> tuple[Any, dict[str, Any]]:
        batch = named(batch)
        return model_inputs(kind, batch), model_keywords(kind, batch, JAX_OPS, logits_chunk)

    def sums(logits: Any, batch: Batch, context: LossContext) -> tuple[Any, Any, dict]:
        return LOSSES[kind](logits, named(batch))

    return TaskLoss(inputs, sums)


def check_logits(apply: Apply, kind: str, params: Any, model_state: Any, batch: Batch) -> ModelOutput:
    """The model's output must be the logits the built-in loss of ``kind`` reads (shapes only; ``batch``
    under the loss's own names); returns the output's shapes."""
    output = jax.eval_shape(
        lambda p, s, b: apply(
            p, s, model_inputs(kind, b), False, jax.random.PRNGKey(0), **model_keywords(kind, b, JAX_OPS)
        ),
        params,
        model_state,
        batch,
    )
    logits = output.logits
    rows = len(batch["weight"])
    wanted = (rows,) if kind == "classifier" else np.shape(batch["tokens"][:, 1:])
    shape = tuple(getattr(logits, "shape", ()))
    if (
        not hasattr(logits, "dtype")
        or not np.issubdtype(logits.dtype, np.floating)
        or shape[:-1] != wanted
        or len(shape) != len(wanted) + 1
    ):
        need = "[batch, classes]" if kind == "classifier" else "[batch, seq_len, vocab]"
        got = f"{np.dtype(logits.dtype).name}{list(shape)}" if hasattr(logits, "dtype") else type(logits).__name__
        raise ConfigError(
            f"the model returns {got}, not the logits {need} (batch {list(wanted)}) the built-in "
            f"{kind} loss reads; return logits from the model or pass loss_fn="
        )
    return output


def builtin_program(
    pieces: ModelPieces, fields: Fields, example_batch: Batch, logits_chunk: LogitsChunk = "off"
) -> Program:
    """The built-in loss of ``fields.kind`` on the model's logits, after checking the model returns logits that
    fit it (shapes only); ``logits_chunk``: see :func:`builtin_task_loss`."""
    loss_kind = fields.kind
    if loss_kind is None:
        raise ValueError("builtin_program needs fields of a built-in loss (require_builtin gives them)")
    params, model_state = init_shapes(pieces.init)
    check_logits(pieces.apply, loss_kind, params, model_state, canonical(fields, example_batch))
    return task_program(pieces, builtin_task_loss(loss_kind, fields, logits_chunk))


def user_program(pieces: ModelPieces, loss_fn: Callable, example_batch: Batch) -> Program:
    """A user loss (either form, :mod:`functrain.core.user_loss`) on the model's parameters, after checking its
    structure and that it returns sums. The loss is the user's whole loss: it calls the model itself."""
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn is a {type(loss_fn).__name__}, not a function; pass "
            f"loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)"
        )
    params, model_state = init_shapes(pieces.init)
    check_user_loss(loss_fn, params, example_batch, model_state)
    check_weight_is_a_count(user_loss(loss_fn), *pieces.init(jax.random.PRNGKey(0)), example_batch)
    return _on_pieces(pieces, user_loss(loss_fn), user_loss(loss_fn, train=False))


def as_program(
    model: Any,
    example_batch: Batch,
    *,
    kind: str | None = None,
    loss_fn: Callable | None = None,
    fields: Fields | None = None,
    logits_chunk: LogitsChunk = "off",
) -> Program:
    """The :class:`Program` of a linen module, an NNX module, a
    :class:`~functrain.core.adapters.FunctionalModel` or a Program, with the built-in loss its data calls for or a
    user loss (research code's entry; runs go through a task).

    Args:
      model: the model object.
      example_batch: one host batch (with ``weight``); linen and plain-function models are initialised on it.
      kind: the built-in loss (``classifier`` / ``causal_lm``); None: the one the data's fields call for.
      loss_fn: a user loss, either form of :mod:`functrain.core.user_loss`; None: the built-in one.
      fields: the batch's roles (:func:`functrain.core.fields.resolve_fields`); None: the conventions.
      logits_chunk: the built-in causal-LM loss over chunks of positions (``train.logits_chunk``: ``auto``, a
        number of positions, ``off``); a run passes its config's.

    Raises ConfigError / DataError (one line) for a model of no known kind, data without the fields the model
    or loss read, output that does not fit the built-in loss, and a ``loss_fn`` of the wrong structure or
    returning a mean.
    """
    if isinstance(model, Program):
        return model
    framework = model_kind_of(model)
    if fields is None and (framework == "linen" or loss_fn is None):  # only what reads the fields needs them
        fields = resolve_fields(example_batch, kind=kind)
    if framework == "linen" and fields is None:
        require_builtin(fields, example_batch)  # names the missing input and the setting that fixes it
    pieces = model_pieces(
        model, model_inputs_of(fields, example_batch), example_batch, fields.argument if fields is not None else None
    )
    if loss_fn is None:
        return builtin_program(pieces, require_builtin(fields, example_batch), example_batch, logits_chunk)
    return user_program(pieces, loss_fn, example_batch)
