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

A model with several kinds of terms (an MoE with multi-token prediction) returns them together as
:class:`CombinedTerms`. The framework adds them to every task's loss (:func:`functrain.core.program.task_program`):
a task never sees them.
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


@flax.struct.dataclass
class CombinedTerms:
    """Several :class:`ModelTerms` as one: their losses and metrics added, each part given the global totals only
    when it asks for them (a micro-batch-scoped part keeps its own forward's sums)."""

    parts: tuple

    @property
    def wants_batch_totals(self) -> bool:
        """Whether any part wants the global batch's totals."""
        return any(part.wants_batch_totals for part in self.parts)

    def batch_totals(self, weight: Any) -> tuple:
        """Each wanting part's totals (None for the others)."""
        return tuple(part.batch_totals(weight) if part.wants_batch_totals else None for part in self.parts)

    def loss_terms(self, weight: Any, totals: Any) -> tuple[Any, dict[str, Any]]:
        """The parts' loss additions summed and their metrics merged."""
        loss_sum: Any = 0.0
        metrics: dict[str, Any] = {}
        for index, part in enumerate(self.parts):
            part_totals = None if totals is None or not part.wants_batch_totals else totals[index]
            extra_sum, extra = part.loss_terms(weight, part_totals)
            loss_sum, metrics = loss_sum + extra_sum, {**metrics, **extra}
        return loss_sum, metrics


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
