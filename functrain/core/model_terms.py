"""Training terms a model's output carries beside its logits (a mixture of experts' balancing losses), added
by every task's loss in one place.

A model's output may be an object with ``.logits`` and two methods:

- ``output.batch_totals(weight) -> tree of sums``: the sums over this forward's tokens that its terms need
  over the whole global batch (an MoE's expert counts), ``weight`` the task's weight sum of this forward;
- ``output.loss_terms(weight, totals) -> (loss_sum, aux_sums)``: what it adds to the task's loss sum and aux
  sums, which the step divides by the global weight like the rest. ``totals`` are the global batch's
  (summed over every micro-batch by a forward-only pass, :func:`functrain.core.step.make_train_step`'s
  ``batch_totals``), or None: this forward's own.

``output.wants_batch_totals`` says whether the step should run that pass when there are several micro-batches
(an MoE balanced over the global batch); with one micro-batch a forward's own sums are the global batch's (jit
sums across devices). Outputs without these methods (plain logits) add nothing.
"""

from typing import Any


def logits_of(output: Any) -> Any:
    """The logits of a model's output: the array itself, or the ``.logits`` of an output object."""
    return getattr(output, "logits", output)


def add_model_terms(output: Any, loss_sum: Any, weight: Any, aux: dict, totals: Any = None) -> tuple[Any, dict]:
    """``(loss_sum, aux)`` with the terms of ``output`` added (unchanged for outputs without terms)."""
    terms = getattr(output, "loss_terms", None)
    if terms is None:
        return loss_sum, aux
    extra_sum, extra_aux = terms(weight, totals)
    return loss_sum + extra_sum, {**aux, **extra_aux}


def batch_totals(output: Any, weight: Any) -> Any:
    """The sums over this forward that ``output``'s terms need over the global batch (None: it has no terms)."""
    totals = getattr(output, "batch_totals", None)
    return None if totals is None else totals(weight)


def wants_batch_totals(output: Any) -> bool:
    """Whether ``output``'s terms need the global batch's totals (see the module docstring)."""
    return bool(getattr(output, "wants_batch_totals", False))
