"""What a model's forward gives every task: one typed :class:`ModelOutput` (its logits, its training terms, its new
state), so that no task has to know which models carry terms.

A model (a Flax module) returns its logits, or a ``ModelOutput(logits, terms)`` when it has training terms of its
own (a mixture of experts' balancing losses); the adapters (:mod:`functrain.core.adapters`) fill in the new model
state. Terms follow the :class:`ModelTerms` protocol:

- ``terms.batch_totals(weight) -> tree of sums``: the sums over this forward's tokens that the terms need over the
  whole global batch (an MoE's expert counts), ``weight`` the task's weight sum of this forward;
- ``terms.loss_terms(weight, totals) -> (loss_sum, aux_sums)``: what they add to the task's loss sum and aux sums,
  which the step divides by the global weight like the rest; ``totals`` are the global batch's (summed over every
  micro-batch by a forward-only pass, :func:`functrain.core.step.make_train_step`'s ``batch_totals``), or None: this
  forward's own;
- ``terms.wants_batch_totals``: whether the step should run that pass when there are several micro-batches (an MoE
  balanced over the global batch); with one micro-batch a forward's own sums are the global batch's.

The framework adds them to every task's loss (:func:`functrain.core.program.task_program`): a task never sees them.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct


class ModelTerms(Protocol):
    """Training terms a model's forward carries beside its logits (see the module docstring)."""

    @property
    def wants_batch_totals(self) -> bool:
        """Whether the terms need the global batch's totals before any micro-batch's gradient."""
        ...

    def batch_totals(self, weight: Any) -> Any:
        """This forward's sums that the terms need over the global batch (no gradient through them)."""
        ...

    def loss_terms(self, weight: Any, totals: Any) -> tuple[Any, dict[str, Any]]:
        """``(loss_sum addition, aux sums)`` over ``totals`` (None: this forward's own)."""
        ...


@flax.struct.dataclass
class ModelOutput:
    """A forward's result: ``logits`` (an array, or an :class:`~functrain.core.unembedding.Unembedding` when the
    head is left unapplied), ``terms`` (a :class:`ModelTerms`, None: none) and the new model ``state`` (None from
    a module itself; the adapters fill it in)."""

    logits: Any
    terms: Any = None
    state: Any = None


def as_output(raw: Any, state: Any) -> ModelOutput:
    """A module's return value (logits, or a :class:`ModelOutput` with terms) as a :class:`ModelOutput` holding
    ``state``."""
    if isinstance(raw, ModelOutput):
        return ModelOutput(raw.logits, raw.terms, state)
    return ModelOutput(raw, None, state)


def logits_of(output: Any) -> Any:
    """The logits of what a module returned: the array itself, or a :class:`ModelOutput`'s ``logits``."""
    return output.logits if isinstance(output, ModelOutput) else output


def add_terms(terms: Any, loss_sum: Any, weight: Any, aux: dict, totals: Any = None) -> tuple[Any, dict]:
    """``(loss_sum, aux)`` with the model's ``terms`` added, scaled by the task's ``weight`` (unchanged for
    None): the one place the framework adds them."""
    if terms is None:
        return loss_sum, aux
    extra_sum, extra_aux = terms.loss_terms(weight, totals)
    return loss_sum + extra_sum, {**aux, **extra_aux}
