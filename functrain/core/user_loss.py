"""A user's loss (``fit(loss_fn=...)``): its two forms in the program's stateful form, and the checks that name
what is wrong with one before anything compiles.

- ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)``, for models without mutable state;
- ``loss_fn(params, batch, rng, model_state) -> (loss_sum, weight, aux_sums, new_model_state)``, as the Flax
  examples write BatchNorm training (``model.apply({"params": params, **model_state}, x, train=True,
  mutable=list(model_state))``). The new state is carried in the TrainState (sharded, checkpointed, restored
  like the built-in path's). Evaluation calls it with ``rng=None``: that is the signal to run the model in
  inference mode (``train=rng is not None``: running averages), and the state it returns is discarded.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import jax
import numpy as np

from functrain.errors import ConfigError, DataError

Batch = dict[str, Any]


def _fields(batch: Batch) -> list[str]:
    return sorted(name for name in batch if name != "weight")


def _positional_arity(loss_fn: Callable) -> int | None:
    """How many positional parameters ``loss_fn`` takes; None when it cannot be read or takes ``*args``."""
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin, some callables)
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in parameters)


def updates_state(loss_fn: Callable) -> bool:
    """Whether a user loss is the state-updating form ``loss_fn(params, batch, rng, model_state)``: four
    positional parameters (the three-argument form has three)."""
    return _positional_arity(loss_fn) == 4


def user_loss(loss_fn: Callable, train: bool = True) -> Callable:
    """A user loss (either form, see the module docstring) in the program's stateful form. In evaluation
    (``train`` False) the state-updating form gets ``rng=None`` and its new state is discarded."""
    if not updates_state(loss_fn):

        def stateful_loss(params, model_state, batch, rng):
            return (*loss_fn(params, batch, rng), model_state)

        return stateful_loss
    if train:
        return lambda params, model_state, batch, rng: tuple(loss_fn(params, batch, rng, model_state))

    def evaluation_loss(params, model_state, batch, rng):
        return (*loss_fn(params, batch, None, model_state)[:3], model_state)

    return evaluation_loss


def _contract(stateful: bool) -> str:
    if stateful:
        return (
            "loss_fn(params, batch, rng, model_state) must return (loss_sum, weight, aux_sums, new_model_state): "
            "scalar sums over the batch, a dict of sums and the model state"
        )
    return "loss_fn must return (loss_sum, weight, aux_sums): scalar sums over the batch and a dict of sums"


def check_user_loss(loss_fn: Callable, params: Any, batch: Batch, model_state: Any = None) -> None:
    """A user loss must take three arguments, or four with ``model_state`` when the model has mutable state,
    and return ``(loss_sum, weight, {name: sum})`` of scalars (plus the new state); shapes only, in training
    and (state-updating form) in evaluation."""
    arity = _positional_arity(loss_fn)
    if arity not in (None, 3, 4):
        raise ConfigError(
            f"loss_fn takes {arity} positional arguments; take (params, batch, rng), or "
            f"(params, batch, rng, model_state) to update the model's mutable state"
        )
    stateful = arity == 4
    has_state = bool(jax.tree.leaves(model_state))
    if has_state and not stateful:
        raise ConfigError(
            "the model has mutable state (batch statistics) and loss_fn takes (params, batch, rng); "
            "take it as loss_fn(params, batch, rng, model_state) and return (loss_sum, weight, "
            "aux_sums, new_model_state)"
        )
    calls = [(jax.random.PRNGKey(0),), (None,)] if stateful else [(jax.random.PRNGKey(0),)]
    for rng in calls:
        arguments = (params, batch, *rng, model_state or {}) if stateful else (params, batch, *rng)
        try:
            result = jax.eval_shape(loss_fn, *arguments)
        except KeyError as exc:
            raise DataError(
                f"loss_fn reads field {exc} which the data does not have (fields: {_fields(batch)}); "
                f"add the field to the data or fix loss_fn"
            ) from None
        _check_result(result, stateful)
        # jaxlib ships no type stub for PyTreeDef, so mypy cannot compare two (ignore below).
        if stateful and jax.tree.structure(result[3]) != jax.tree.structure(model_state or {}):  # type: ignore[operator]
            raise ConfigError(
                f"loss_fn returned a new model state of another structure than the one it was given "
                f"({sorted(model_state or {})}); return the updated model_state itself (e.g. the "
                f"updates of apply(..., mutable=list(model_state)))"
            )


def _described(value: Any) -> str:
    """What a loss returned, as shapes (``float32[]``, ``a 2-tuple (float32[], float32[])``), not as the
    ``ShapeDtypeStruct`` it was traced to."""
    if isinstance(value, tuple):
        return f"a {len(value)}-tuple ({', '.join(_described(item) for item in value)})"
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{np.dtype(value.dtype).name}{list(value.shape)}"
    return type(value).__name__


def _check_result(result: Any, stateful: bool) -> None:
    size = 4 if stateful else 3
    if not isinstance(result, tuple) or len(result) != size:
        got = _described(result) if isinstance(result, tuple) else f"one value, {_described(result)}"
        raise ConfigError(f"loss_fn returned {got} where a {size}-tuple was expected; {_contract(stateful)}")
    loss_sum, weight, aux = result[:3]
    if not isinstance(aux, dict):
        raise ConfigError(f"loss_fn returned aux of type {type(aux).__name__}; {_contract(stateful)}")
    for name, value in {
        "loss_sum": loss_sum,
        "weight": weight,
        **{f"aux[{key!r}]": value for key, value in aux.items()},
    }.items():
        if getattr(value, "shape", None) != ():
            raise ConfigError(
                f"loss_fn returned {name} of shape {getattr(value, 'shape', type(value).__name__)}, "
                f"not a scalar (shape ()); {_contract(stateful)}"
            )


def check_weight_is_a_count(loss_fn: Callable, params: Any, model_state: Any, batch: Batch) -> None:
    """A loss returning a mean (weight 1 for a batch of several records) would make accumulation and
    multi-device sums wrong silently; one evaluation on the example batch catches it (``loss_fn`` in the
    program's stateful form)."""
    rows = int(np.sum(np.asarray(batch["weight"]) > 0))
    weight = float(jax.jit(loss_fn)(params, model_state, batch, jax.random.PRNGKey(0))[1])
    if rows > 1 and weight <= 1.0:
        raise ConfigError(
            f"loss_fn returned weight {weight:g} for a batch of {rows} records: it looks like a mean; "
            f"return sums (loss_sum, weight = examples or tokens counted, aux sums), the step "
            f"divides once by the total weight"
        )
