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

# apply(params, model_state, inputs, train, rng) -> (output, model_state), the program's form.
Apply = Callable[[Any, Any, Any, bool, jax.Array], tuple[Any, Any]]

# The model-state entry holding the frozen reference weights (runs without adapters).
REFERENCE = "reference"


@dataclass(frozen=True)
class WithReference:
    """A model's pieces with its reference: ``init`` and ``apply`` of the policy (carrying the reference's entry in
    the model state through), ``reference(params, model_state, inputs) -> output`` (evaluation mode, no gradient
    reaches the policy through it) and ``state_for_params`` (None: ``init``'s model state is right)."""

    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Apply
    reference: Callable[[Any, Any, Any], Any]
    state_for_params: Callable[[Any, Any], Any] | None


def reference_weights(params: Any, model_state: Any) -> Any:
    """The frozen copy of the starting weights kept in ``model_state``, in the params' dtype
    (``train.compute_dtype``), so that the first step compares like with like."""
    return jax.tree.map(lambda ref, p: ref.astype(p.dtype), model_state[REFERENCE], params)


def _inner(model_state: Any) -> Any:
    return {name: value for name, value in model_state.items() if name != REFERENCE}


def with_reference(init: Callable, apply: Apply, reference_apply: Apply | None = None) -> WithReference:
    """The policy ``init``/``apply`` and its reference: ``reference_apply`` on the same params when given (LoRA's
    base), else a frozen copy of the starting weights kept in the model state."""
    if reference_apply is not None:

        def base(params, model_state, inputs):
            output = reference_apply(params, model_state, inputs, False, jax.random.PRNGKey(0))[0]
            return jax.lax.stop_gradient(output)

        return WithReference(init, apply, base, None)

    def init_with_copy(rng):
        params, model_state = init(rng)
        return params, {**model_state, REFERENCE: params}

    def apply_policy(params, model_state, inputs, train, rng, **keywords):
        output, new_state = apply(params, _inner(model_state), inputs, train, rng, **keywords)
        return output, {**new_state, REFERENCE: model_state[REFERENCE]}

    def frozen(params, model_state, inputs):
        output = apply(
            reference_weights(params, model_state), _inner(model_state), inputs, False, jax.random.PRNGKey(0)
        )[0]
        return jax.lax.stop_gradient(output)

    def state_for_params(params, model_state):
        return {**_inner(model_state), REFERENCE: params}

    return WithReference(init_with_copy, apply_policy, frozen, state_for_params)
