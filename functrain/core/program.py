"""A Program: what the JAX backend needs from a model and a task's loss, whatever framework wrote the model.

    ModelPieces(init, apply, logical_specs, framework, frozen_apply=None, trainable=None, complete_params=None,
                end_of_step=None)
      init(rng) -> (params, model_state)                          # float32 params; {} when nothing mutable
      apply(params, model_state, inputs, train, rng, **keywords) -> (output, model_state)
      logical_specs() -> tree of PartitionSpec of logical axis names (PartitionSpec() where none)
      frozen_apply: the same params with a transform's trainable delta off (LoRA's base model), or None
      trainable(params) -> tree of bools: the leaves the step trains (None: all); the rest stay frozen
      complete_params(restored_params, init_rng) -> params: fills what a restored checkpoint lacks (LoRA
        adapters on a converted base model); None: checkpoints restore straight onto the params' shardings
      adapter_checkpoints: saves hold the base weights once, then the trainable adapters only (LoRA's policy)
      end_of_step(params, model_state) -> (params, model_state): run once after each applied update (DeepSeek's
        correction biases moved by the selections its forwards counted in model state); None: nothing

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
        :mod:`functrain.core.model_terms`); the step runs it forward-only over every micro-batch and passes the
        total as ``loss_fn(..., totals=...)``; None: the loss needs none
      end_of_step: the model's (ModelPieces above)

A task (:mod:`functrain.tasks`) builds its Program on the model's pieces (:func:`program_on`), after transforms
(LoRA: :func:`functrain.models.lora.lora_transform`) turned the pieces into others.

Adapters turn user code into one (:func:`as_program`):

- a Flax linen module: variables from ``module.init``; every collection but ``params`` (``batch_stats``)
  is model state, updated in training mode through ``mutable=``; logical specs from ``nn.Partitioned`` boxes;
  a module's own ``trainable_mask(params)`` and ``end_of_step(params, model_state)`` methods, when it has them,
  are the pieces' ``trainable`` and ``end_of_step`` (DeepSeek-V3's correction biases);
- a Flax NNX module: ``nnx.split`` into a graph definition and ``Param`` / other state, merged again inside
  the pure loss; its RNG streams are reseeded from the step key, so no RNG state is carried;
- :class:`FunctionalModel` ``(init, apply)``: ``init(rng, example_batch) -> params``,
  ``apply(params, inputs) -> logits``.

A model's output (logits, or an object with ``.logits``) feeds the built-in loss of its kind (see
:mod:`functrain.core.losses`; the fields it reads follow :mod:`functrain.core.fields`; a packed LM batch's
``segment_ids`` / ``positions`` reach the model as keyword arguments, an HF batch's ``attention_mask`` too
when the model's call takes it). A user loss replaces it, in one of two forms (told apart by arity):

- ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)``, for models without mutable state;
- ``loss_fn(params, batch, rng, model_state) -> (loss_sum, weight, aux_sums, new_model_state)``, as the Flax
  examples write BatchNorm training (``model.apply({"params": params, **model_state}, x, train=True,
  mutable=list(model_state))``). The new state is carried in the TrainState (sharded, checkpointed, restored
  like the built-in path's). Evaluation calls it with ``rng=None``: that is the signal to run the model in
  inference mode (``train=rng is not None``: running averages), and the state it returns is discarded.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec

from functrain.core.fields import Fields, canonical, require_builtin, resolve_fields
from functrain.core.losses import JAX_OPS, LOSSES, TOKEN_MASK, model_inputs, model_keywords
from functrain.core.model_terms import add_model_terms, batch_totals, logits_of, wants_batch_totals
from functrain.core.unembedding import LOGITS_CHUNK, LogitsChunk
from functrain.errors import ConfigError, DataError

if TYPE_CHECKING:
    from flax import nnx

Batch = dict[str, Any]
# apply(params, model_state, inputs, train, rng, **keywords) -> (output, model_state)
Apply = Callable[[Any, Any, Any, bool, jax.Array], tuple[Any, Any]]


@dataclass(frozen=True)
class ModelPieces:
    """A model as pure functions, and what a transform froze (see the module docstring)."""

    init: Callable[[jax.Array], tuple[Any, Any]]
    apply: Apply
    logical_specs: Callable[[], Any]
    framework: str  # linen / nnx / functions (see model_kind_of)
    frozen_apply: Apply | None = None
    trainable: Callable[[Any], Any] | None = None
    complete_params: Callable[[Any, jax.Array], Any] | None = None
    adapter_checkpoints: bool = False  # checkpoints hold the trainable leaves once the base is saved
    end_of_step: Callable[[Any, Any], tuple[Any, Any]] | None = None


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


def program_on(
    pieces: ModelPieces,
    loss_fn: Callable,
    eval_loss_fn: Callable,
    *,
    init: Callable[[jax.Array], tuple[Any, Any]] | None = None,
    state_for_params: Callable[[Any, Any], Any] | None = None,
    state_logical_specs: Callable[[], dict[str, Any]] | None = None,
    batch_totals: Callable | None = None,
) -> Program:
    """The Program of a loss built on ``pieces``, keeping what their transforms froze (``init``: the pieces'
    unless the task adds model-state entries of its own, ``state_logical_specs`` the logical axes of those,
    ``batch_totals`` the global sums its loss needs first)."""
    return Program(
        init or pieces.init,
        loss_fn,
        eval_loss_fn,
        pieces.logical_specs,
        trainable=pieces.trainable,
        complete_params=pieces.complete_params,
        state_for_params=state_for_params,
        state_logical_specs=state_logical_specs,
        batch_totals=batch_totals,
        end_of_step=pieces.end_of_step,
    )


class FunctionalModel(NamedTuple):
    """A model as two plain functions: ``init(rng, example_batch) -> params``, ``apply(params, inputs) -> logits``.

    A plain ``(init, apply)`` tuple is accepted as well.
    """

    init: Callable[[jax.Array, Batch], Any]
    apply: Callable[[Any, Any], Any]


# ------------------------------------------------------------------------------------------ adapters


def _mode_kwargs(module: nn.Module, train: bool) -> dict[str, Any]:
    """``deterministic=not train`` or ``train=train``, whichever the module's ``__call__`` takes."""
    parameters = inspect.signature(type(module).__call__).parameters
    if "deterministic" in parameters:
        return {"deterministic": not train}
    if "train" in parameters:
        return {"train": train}
    return {}


def _keyword_names(call: Callable) -> set[str] | None:
    """The keywords ``call`` takes by name; None when it takes any (``**kwargs``)."""
    parameters = inspect.signature(call).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters}


def _supported(keywords: dict[str, Any], names: set[str] | None) -> dict[str, Any]:
    """``keywords`` as the model takes them. An HF ``attention_mask`` goes to a model that takes no such
    argument as ``segment_ids`` when it takes those (functrain's models): padding and real tokens are then two
    segments, so no real token attends to a padded key, as with HF's mask. A model that takes neither gets
    no mask: exact for right padding, where only padded queries (never counted) see padded keys. The
    ``token_mask`` and the ``logits_chunk`` setting go only to a model whose call names them."""
    keywords = {
        name: value
        for name, value in keywords.items()
        if name not in (TOKEN_MASK, LOGITS_CHUNK) or (names is not None and name in names)
    }
    if "attention_mask" not in keywords or names is None or "attention_mask" in names:
        return keywords
    kept = {name: value for name, value in keywords.items() if name != "attention_mask"}
    if "segment_ids" in names and "segment_ids" not in kept:
        kept["segment_ids"] = keywords["attention_mask"]
    return kept


def _call_inputs(inputs: Any, argument: str | None) -> tuple[tuple, dict[str, Any]]:
    """The model's inputs as call arguments: positional, or the keyword ``argument`` (a field map's)."""
    return ((), {argument: inputs}) if argument else ((inputs,), {})


def linen_pieces(
    module: nn.Module, example_inputs: Any, argument: str | None = None
) -> tuple[Callable, Apply, Callable]:
    """``(init, apply, logical_specs)`` of a linen module called on ``example_inputs``-like inputs
    (positionally, or as the keyword ``argument``)."""

    def init_variables(rng: jax.Array) -> Any:  # a dict or FrozenDict of the variable collections
        args, named = _call_inputs(example_inputs, argument)
        return module.init({"params": rng, "dropout": rng}, *args, **named, **_mode_kwargs(module, False))

    def init(rng: jax.Array) -> tuple[Any, Any]:
        variables = nn.meta.unbox(dict(init_variables(rng)))
        params = variables.pop("params", {})
        return params, variables

    keyword_names = _keyword_names(type(module).__call__)

    def apply(
        params: Any, model_state: Any, inputs: Any, train: bool, rng: jax.Array, **keywords: Any
    ) -> tuple[Any, Any]:
        args, named = _call_inputs(inputs, argument)
        keywords = {**_supported(keywords, keyword_names), **named}
        variables = {"params": params, **model_state}
        if train and model_state:
            output, updates = module.apply(
                variables,
                *args,
                rngs={"dropout": rng},
                mutable=list(model_state),
                **_mode_kwargs(module, True),
                **keywords,
            )
            return output, {**model_state, **updates}
        output = module.apply(variables, *args, rngs={"dropout": rng}, **_mode_kwargs(module, train), **keywords)
        return output, model_state

    def logical_specs() -> Any:
        return nn.get_partition_spec(jax.eval_shape(init_variables, jax.random.PRNGKey(0)).get("params", {}))

    return init, apply, logical_specs


def _nnx_rebuild(template: nnx.State, pure: Any) -> nnx.State:
    """An ``nnx.State`` shaped like ``template`` holding the leaves of its pure-dict form ``pure``
    (both flatten in the same key order)."""
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(pure))


def nnx_pieces(module: nnx.Module, argument: str | None = None) -> tuple[Callable, Apply, Callable]:
    """``(init, apply, logical_specs)`` of an NNX module: params are the ``nnx.Param`` variables as a pure
    dict, model state every other variable except RNG streams (reseeded from the step key on each call);
    inputs go positionally, or as the keyword ``argument``."""
    from flax import nnx

    # nnx.split's stub returns a variadic tuple; three filters and the rest give four parts (ignore below).
    graphdef, params, rng_state, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)  # type: ignore[misc]
    initial = (nnx.to_pure_dict(params), nnx.to_pure_dict(rest))

    def init(rng: jax.Array) -> tuple[Any, Any]:
        return initial  # the module object was initialised by its own constructor

    def fresh_streams(rng: jax.Array) -> nnx.State:
        leaves = jax.tree.leaves(rng_state)
        keys = [
            jax.random.wrap_key_data(jax.random.fold_in(rng, index))
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            else leaf
            for index, leaf in enumerate(leaves)
        ]
        return jax.tree.unflatten(jax.tree.structure(rng_state), keys)

    keyword_names = _keyword_names(type(module).__call__)

    def apply(
        params_pure: Any, model_state: Any, inputs: Any, train: bool, rng: jax.Array, **keywords: Any
    ) -> tuple[Any, Any]:
        keywords = _supported(keywords, keyword_names)
        model = nnx.merge(
            graphdef, _nnx_rebuild(params, params_pure), fresh_streams(rng), _nnx_rebuild(rest, model_state)
        )
        model.train() if train else model.eval()
        args, named = _call_inputs(inputs, argument)
        output = model(*args, **keywords, **named)
        if not train:
            return output, model_state
        return output, nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[-1])  # the rest

    def logical_specs() -> Any:
        specs = nnx.get_partition_spec(params)
        return jax.tree.map(
            lambda leaf: leaf if isinstance(leaf, PartitionSpec) else PartitionSpec(),
            nnx.to_pure_dict(specs),
            is_leaf=lambda leaf: isinstance(leaf, PartitionSpec),
        )

    return init, apply, logical_specs


def functional_pieces(model: FunctionalModel, example_batch: Batch) -> tuple[Callable, Apply, Callable]:
    """``(init, apply, logical_specs)`` of plain functions (no model state, no logical axes)."""
    init_fn, apply_fn = model

    def init(rng: jax.Array) -> tuple[Any, Any]:
        return init_fn(rng, example_batch), {}

    keyword_names = _keyword_names(apply_fn)

    def apply(
        params: Any, model_state: Any, inputs: Any, train: bool, rng: jax.Array, **keywords: Any
    ) -> tuple[Any, Any]:
        return apply_fn(params, inputs, **_supported(keywords, keyword_names)), model_state

    def logical_specs() -> Any:
        return jax.tree.map(lambda _: PartitionSpec(), jax.eval_shape(init, jax.random.PRNGKey(0))[0])

    return init, apply, logical_specs


def model_kind_of(model: Any) -> str:
    """``linen``, ``nnx`` or ``functions``; anything else is a one-line ConfigError."""
    if isinstance(model, nn.Module):
        return "linen"
    # An NNX module exists only where its author imported flax.nnx: a process without one never imports it (it
    # is over a third of a second of every start-up).
    nnx_package = sys.modules.get("flax.nnx")
    if nnx_package is not None and isinstance(model, nnx_package.Module):
        return "nnx"
    if isinstance(model, tuple) and len(model) == 2 and all(callable(part) for part in model):
        return "functions"
    raise ConfigError(
        f"model {type(model).__name__} is not a Flax linen module, an NNX module or "
        f"FunctionalModel(init, apply); pass one of those (a torch nn.Module needs backend: torch)"
    )


# ---------------------------------------------------------------------------------------------- losses


def _fields(batch: Batch) -> list[str]:
    return sorted(name for name in batch if name != "weight")


def _builtin_forward(
    apply: Apply, kind: str, train: bool, fields: Fields | None, logits_chunk: LogitsChunk = "off"
) -> Callable:
    """``forward(params, model_state, batch, rng) -> (output, (loss_sum, weight, aux), new_state)``."""
    sums = LOSSES[kind]

    def forward(params, model_state, batch, rng):
        batch = batch if fields is None else canonical(fields, batch)
        keywords = model_keywords(kind, batch, JAX_OPS, logits_chunk)
        output, new_state = apply(params, model_state, model_inputs(kind, batch), train, rng, **keywords)
        return output, sums(logits_of(output), batch), new_state

    return forward


def builtin_loss(
    apply: Apply, kind: str, train: bool, fields: Fields | None = None, logits_chunk: LogitsChunk = "off"
) -> Callable:
    """The built-in loss of ``kind`` on the logits of ``apply``, in the stateful form, with the terms the
    model's output carries (:mod:`functrain.core.model_terms`; ``totals``: the global batch's sums they need,
    None: this batch's own); ``fields``: the batch's roles when its names are not the loss's own (see
    :func:`functrain.core.fields.canonical`); ``logits_chunk``: a causal LM's cross-entropy over chunks of
    positions (:mod:`functrain.core.unembedding`; a model that does not take the setting gives its logits)."""
    forward = _builtin_forward(apply, kind, train, fields, logits_chunk)

    def loss_fn(params, model_state, batch, rng, totals=None):
        output, (loss_sum, weight, aux), new_state = forward(params, model_state, batch, rng)
        loss_sum, aux = add_model_terms(output, loss_sum, weight, aux, totals)
        return loss_sum, weight, aux, new_state

    return loss_fn


def builtin_batch_totals(apply: Apply, kind: str, fields: Fields | None = None) -> Callable:
    """``(params, model_state, batch, rng) -> the sums`` a training forward's terms need over the global batch
    (:func:`functrain.core.model_terms.batch_totals`)."""
    forward = _builtin_forward(apply, kind, True, fields)

    def totals_fn(params, model_state, batch, rng):
        output, (_, weight, _), _ = forward(params, model_state, batch, rng)
        return batch_totals(output, weight)

    return totals_fn


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


def check_logits(apply: Apply, kind: str, params: Any, model_state: Any, batch: Batch) -> Any:
    """The model's output must be the logits the built-in loss of ``kind`` reads (shapes only; ``batch``
    under the loss's own names); returns the output (shapes: what else it carries, :mod:`.model_terms`)."""
    model_output = jax.eval_shape(
        lambda p, s, b: apply(
            p, s, model_inputs(kind, b), False, jax.random.PRNGKey(0), **model_keywords(kind, b, JAX_OPS)
        )[0],
        params,
        model_state,
        batch,
    )
    output = logits_of(model_output)
    rows = len(batch["weight"])
    wanted = (rows,) if kind == "classifier" else np.shape(batch["tokens"][:, 1:])
    shape = tuple(getattr(output, "shape", ()))
    if (
        not hasattr(output, "dtype")
        or not np.issubdtype(output.dtype, np.floating)
        or shape[:-1] != wanted
        or len(shape) != len(wanted) + 1
    ):
        need = "[batch, classes]" if kind == "classifier" else "[batch, seq_len, vocab]"
        got = f"{np.dtype(output.dtype).name}{list(shape)}" if hasattr(output, "dtype") else type(output).__name__
        raise ConfigError(
            f"the model returns {got}, not the logits {need} (batch {list(wanted)}) the built-in "
            f"{kind} loss reads; return logits from the model or pass loss_fn="
        )
    return model_output


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


# ---------------------------------------------------------------------------------------------- entry


def model_inputs_of(fields: Fields | None, example_batch: Batch) -> Any:
    """What a model is called on in a batch of these ``fields``: the built-in loss's inputs, or the named input
    field (the batch itself when no field is named: a FunctionalModel's ``init`` reads it whole)."""
    if fields is None:
        return example_batch
    return model_inputs(fields.kind, canonical(fields, example_batch)) if fields.kind else example_batch[fields.inputs]


def model_pieces(model: Any, inputs: Any, example_batch: Batch, argument: str | None = None) -> ModelPieces:
    """The :class:`ModelPieces` of a linen module (initialised on ``inputs``, passed positionally or as the
    keyword ``argument``), an NNX module or a :class:`FunctionalModel` (``init`` reads ``example_batch``)."""
    framework = model_kind_of(model)
    if framework == "nnx":
        return ModelPieces(*nnx_pieces(model, argument), framework=framework)
    if framework == "linen":
        return ModelPieces(
            *linen_pieces(model, inputs, argument),
            framework=framework,
            trainable=getattr(model, "trainable_mask", None),
            end_of_step=getattr(model, "end_of_step", None),
        )
    if argument is not None:
        raise ConfigError(
            f"data.fields.inputs passes the input as the keyword {argument!r}, and FunctionalModel's "
            f"apply(params, inputs) takes its inputs positionally; name the field alone"
        )
    return ModelPieces(*functional_pieces(model, example_batch), framework=framework)


def builtin_program(
    pieces: ModelPieces, fields: Fields, example_batch: Batch, logits_chunk: LogitsChunk = "off"
) -> Program:
    """The built-in loss of ``fields.kind`` on the model's logits, after checking the model returns logits that
    fit it (shapes only); ``logits_chunk``: see :func:`builtin_loss`."""
    loss_kind = fields.kind
    if loss_kind is None:
        raise ValueError("builtin_program needs fields of a built-in loss (require_builtin gives them)")
    params, model_state = jax.eval_shape(pieces.init, jax.random.PRNGKey(0))
    output = check_logits(pieces.apply, loss_kind, params, model_state, canonical(fields, example_batch))
    return program_on(
        pieces,
        builtin_loss(pieces.apply, loss_kind, True, fields, logits_chunk),
        builtin_loss(pieces.apply, loss_kind, False, fields, logits_chunk),
        batch_totals=builtin_batch_totals(pieces.apply, loss_kind, fields) if wants_batch_totals(output) else None,
    )


def user_program(pieces: ModelPieces, loss_fn: Callable, example_batch: Batch) -> Program:
    """A user loss (either form of the module docstring) on the model's parameters, after checking its
    structure and that it returns sums."""
    if not callable(loss_fn):
        raise ConfigError(
            f"loss_fn is a {type(loss_fn).__name__}, not a function; pass "
            f"loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)"
        )
    params, model_state = jax.eval_shape(pieces.init, jax.random.PRNGKey(0))
    check_user_loss(loss_fn, params, example_batch, model_state)
    check_weight_is_a_count(user_loss(loss_fn), *pieces.init(jax.random.PRNGKey(0)), example_batch)
    return program_on(pieces, user_loss(loss_fn), user_loss(loss_fn, train=False))


def as_program(
    model: Any,
    example_batch: Batch,
    *,
    kind: str | None = None,
    loss_fn: Callable | None = None,
    fields: Fields | None = None,
    logits_chunk: LogitsChunk = "off",
) -> Program:
    """The :class:`Program` of a linen module, an NNX module, a :class:`FunctionalModel` or a Program, with the
    built-in loss its data calls for or a user loss (research code's entry; runs go through a task).

    Args:
      model: the model object.
      example_batch: one host batch (with ``weight``); linen and plain-function models are initialised on it.
      kind: the built-in loss (``classifier`` / ``causal_lm``); None: the one the data's fields call for.
      loss_fn: a user loss, either form of the module docstring; None: the built-in one.
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
