"""Model adapters: a Flax linen module, a Flax NNX module or two plain functions as :class:`ModelPieces`, the pure
functions every task's program is built on.

    ModelPieces(init, apply, logical_specs, framework, frozen_apply=None, trainable=None, complete_params=None,
                end_of_step=None)
      init(rng) -> (params, model_state)                          # float32 params; {} when nothing mutable
      apply(params, model_state, inputs, train, rng, **keywords) -> ModelOutput(logits, terms, state)
        (:mod:`functrain.core.model_output`: the logits, the model's training terms, its new model state)
      logical_specs() -> tree of PartitionSpec of logical axis names (PartitionSpec() where none)
      frozen_apply: the same params with a transform's trainable delta off (LoRA's base model), or None
      trainable(params) -> tree of bools: the leaves the step trains (None: all); the rest stay frozen
      complete_params(restored_params, init_rng) -> params: fills what a restored checkpoint lacks (LoRA
        adapters on a converted base model); None: checkpoints restore straight onto the params' shardings
      adapter_checkpoints: saves hold the base weights once, then the trainable adapters only (LoRA's policy)
      end_of_step(params, model_state) -> (params, model_state): run once after each applied update (DeepSeek's
        correction biases moved by the selections its forwards counted in model state); None: nothing

- a Flax linen module: variables from ``module.init``; every collection but ``params`` (``batch_stats``)
  is model state, updated in training mode through ``mutable=``; logical specs from ``nn.Partitioned`` boxes;
  a module's own ``trainable_mask(params)`` and ``end_of_step(params, model_state)`` methods, when it has them,
  are the pieces' ``trainable`` and ``end_of_step`` (DeepSeek-V3's correction biases);
- a Flax NNX module: ``nnx.split`` into a graph definition and ``Param`` / other state, merged again inside
  the pure loss; its RNG streams are reseeded from the step key, so no RNG state is carried;
- :class:`FunctionalModel` ``(init, apply)``: ``init(rng, example_batch) -> params``,
  ``apply(params, inputs) -> logits``.

A packed LM batch's ``segment_ids`` / ``positions`` reach the model as keyword arguments, an HF batch's
``attention_mask`` too when the model's call takes it.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from functrain.core.fields import Fields, canonical
from functrain.core.losses import TOKEN_MASK, model_inputs
from functrain.core.model_output import ModelOutput, as_output
from functrain.core.unembedding import LOGITS_CHUNK
from functrain.errors import ConfigError

if TYPE_CHECKING:
    from flax import nnx

Batch = dict[str, Any]
# apply(params, model_state, inputs, train, rng, **keywords) -> ModelOutput(logits, terms, state)
Apply = Callable[..., ModelOutput]
Init = Callable[[jax.Array], tuple[Any, Any]]

# What each init function's output looks like, traced once: a build asks several times (the task's checks, LoRA's
# trainable mask, the train state and its shardings), and tracing a large model's init takes seconds. Keyed by the
# function, so a new build (new functions) traces again. A value is the shapes, or a function that derives them from
# a trace made anyway (a linen module's boxed variables, traced for its logical axes).
_INIT_SHAPES: weakref.WeakKeyDictionary[Init, Any] = weakref.WeakKeyDictionary()


def init_shapes(init: Init) -> tuple[Any, Any]:
    """``jax.eval_shape(init, key)``: the ``jax.ShapeDtypeStruct`` trees of ``init``'s params and model state (they
    do not depend on the key), traced once per init function; shared by every caller, so never modified."""
    shapes = _INIT_SHAPES.get(init)
    if shapes is None:
        shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
    elif callable(shapes):
        shapes = shapes()
    _INIT_SHAPES[init] = shapes
    return shapes


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

    def split(variables: Any) -> tuple[Any, Any]:
        variables = nn.meta.unbox(dict(variables))
        params = variables.pop("params", {})
        return params, variables

    def init(rng: jax.Array) -> tuple[Any, Any]:
        return split(init_variables(rng))

    @functools.cache
    def boxed_shapes() -> Any:  # one trace gives the logical axes and init's shapes
        return jax.eval_shape(init_variables, jax.random.PRNGKey(0))

    _INIT_SHAPES[init] = lambda: jax.eval_shape(split, boxed_shapes())  # unboxing, traced: no model in it

    keyword_names = _keyword_names(type(module).__call__)

    def apply(params: Any, model_state: Any, inputs: Any, train: bool, rng: jax.Array, **keywords: Any) -> ModelOutput:
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
            return as_output(output, {**model_state, **updates})
        output = module.apply(variables, *args, rngs={"dropout": rng}, **_mode_kwargs(module, train), **keywords)
        return as_output(output, model_state)

    def logical_specs() -> Any:
        return nn.get_partition_spec(boxed_shapes().get("params", {}))

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
    ) -> ModelOutput:
        keywords = _supported(keywords, keyword_names)
        model = nnx.merge(
            graphdef, _nnx_rebuild(params, params_pure), fresh_streams(rng), _nnx_rebuild(rest, model_state)
        )
        model.train() if train else model.eval()
        args, named = _call_inputs(inputs, argument)
        output = model(*args, **keywords, **named)
        if not train:
            return as_output(output, model_state)
        return as_output(output, nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[-1]))  # the rest

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

    def apply(params: Any, model_state: Any, inputs: Any, train: bool, rng: jax.Array, **keywords: Any) -> ModelOutput:
        return as_output(apply_fn(params, inputs, **_supported(keywords, keyword_names)), model_state)

    def logical_specs() -> Any:
        return jax.tree.map(lambda _: PartitionSpec(), init_shapes(init)[0])

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
