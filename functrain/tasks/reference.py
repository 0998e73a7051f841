"""The frozen reference model of the tasks that compare the policy with its starting weights (preference's DPO,
GRPO's KL term).

The reference is the model with a transform's trainable delta off when there is one (LoRA's base: no second copy
of the weights), else a frozen copy of the starting weights in the model state under :data:`REFERENCE`: never
differentiated nor seen by the optimizer, sharded like the params, checkpointed with the state, and set to the
loaded weights when a run starts from a converted checkpoint (``state_for_params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax

from functrain.core.adapters import Apply
from functrain.core.program import TaskState

# The model-state entry holding the frozen reference weights (runs without adapters).
REFERENCE = "reference"


@dataclass(frozen=True)
class Reference:
    """A policy's frozen reference: ``logits(params, model_state, inputs)`` (evaluation mode, outside the gradient;
    ``model_state`` the whole state, with the task's entries) and the model-state entry it keeps (None: none, the
    reference is a transform's base)."""

    logits: Callable[[Any, Any, Any], Any]
    state: TaskState | None


def reference_weights(params: Any, model_state: Any) -> Any:
    """The frozen copy of the starting weights kept in ``model_state``, in the params' dtype
    (``train.compute_dtype``), so that the first step compares like with like."""
    return jax.tree.map(lambda ref, p: ref.astype(p.dtype), model_state[REFERENCE], params)


def reference_of(apply: Apply, reference_apply: Apply | None = None) -> Reference:
    """The reference of a policy computed by ``apply``: ``reference_apply`` on the same params when given (LoRA's
    base), else a frozen copy of the starting weights kept in the model state."""
    if reference_apply is not None:

        def base(params, model_state, inputs):
            output = reference_apply(params, model_state, inputs, False, jax.random.PRNGKey(0))
            return jax.lax.stop_gradient(output.logits)

        return Reference(base, None)

    state = TaskState((REFERENCE,), lambda params: {REFERENCE: params}, from_params=True)

    def frozen(params, model_state, inputs):
        weights = reference_weights(params, model_state)
        output = apply(weights, state.outside(model_state), inputs, False, jax.random.PRNGKey(0))
        return jax.lax.stop_gradient(output.logits)

    return Reference(frozen, state)
