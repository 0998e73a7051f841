"""Resolve a run's parts: the config's names (and the objects given to ``fit``) as objects, for the CLI,
``fit(path)`` and ``fit(config, model=..., ...)`` alike.

An object passed to ``fit`` wins; otherwise the config names it: ``model.name`` (the registry in
:mod:`functrain.models`) or ``model.target``; ``data.name`` (:mod:`functrain.data.datasets`; ``tokens``: a token
store, :mod:`functrain.data.token_windows`) or ``data.target``; ``optimizer.name`` (:mod:`functrain.core.optim`) or
``optimizer.target``. Import paths are ``"package.module:attribute"``; one that does not resolve or gives the
wrong kind of object is a one-line ConfigError naming it. :func:`functrain.run.build.build` then makes the
backend and the rest of the run from these parts.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import optax

from functrain.core.optim import OptimizerSettings, ScheduleSettings, named_optimizer
from functrain.run.config import PYTHON_OBJECT
from functrain.data import ConcatSource, Mixture, Source, Stream, as_data, as_source
from functrain.data.stream import is_stream
from functrain.data.transforms import Transform, apply_transform
from functrain.data.validate import BatchCheck, FieldRule, check_arrays
from functrain.data.datasets import load_dataset, open_source, split_records, token_store
from functrain.data.synthetic import synthetic_splits
from functrain.errors import ConfigError, DataError
from functrain.models import build_model, model_spec
from functrain.core.fields import Fields, require_builtin, resolve_fields
from functrain.core.losses import batch_check
from functrain.core.preference import PreferenceSettings


@dataclass(frozen=True)
class Parts:
    """What a run is built from.

    Attributes:
      model: the model object; None with ``backend: torch`` and a registry model (the bridge builds it).
      kind: the built-in loss (``classifier`` / ``causal_lm``): the registry's, ``model.kind`` or the one the
        data's fields call for; None with a user ``loss_fn``.
      fields: the roles of the data's fields (:mod:`functrain.core.fields`: conventions, or ``data.fields``);
        None with a user ``loss_fn`` and no ``data.fields`` (the model adapter then follows the conventions).
      loss_fn: a user ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)``, or None (built-in).
      optimizer: a user optimizer (transformation or function of the schedule) and what to call it in
        errors, or None (``optimizer.name``).
      train_data, eval_data: data sources (a :class:`Mixture` or, for training, a :class:`Stream` too;
        ``eval_data`` None: no evaluation).
      batch_check: what the built-in loss reads, checked on every batch (None with a user ``loss_fn``).
      transform: ``transform(record, rng) -> record`` applied to every record read (``fit(transform=)`` or
        ``data.transform``), or None.
      notes: warnings found while reading the data, shown when the run starts.

    ``data.name: preference`` makes ``kind`` ``preference``: pairs tokenised by :mod:`functrain.text.preference`,
    trained with the loss of :mod:`functrain.core.preference` (``preference.*``).
    """
    model: Any
    kind: str | None
    fields: Fields | None
    loss_fn: Callable | None
    optimizer: tuple[Any, str] | None
    train_data: Source | Stream
    eval_data: Source | None
    batch_check: BatchCheck | None
    transform: Transform | None = None
    notes: tuple[str, ...] = ()   # warnings about the data (identical preference pairs, dropped pairs)


def describe_object(obj: Any) -> str:
    """``package.module.Name`` of an object's type (of a function pair: of its ``init``), for the record."""
    if isinstance(obj, tuple) and obj and callable(obj[0]):
        obj = obj[0]
    named = obj if inspect.isfunction(obj) or isinstance(obj, type) else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def import_target(path: str, what: str) -> Any:
    """The object at ``"package.module:attribute"``; a path that does not resolve is a ConfigError naming it."""
    module_name, _, attribute = path.partition(":")
    fix = "fix the import path (package.module:attribute, importable from the working directory or PYTHONPATH)"
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{what}={path!r} does not resolve: cannot import {module_name!r} ({exc}); {fix}") from None
    obj = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{what}={path!r} does not resolve: {module_name!r} has no attribute {attribute!r}; "
                              f"{fix}")
        obj = getattr(obj, part)
    return obj


def call_target(path: str, kwargs: dict[str, Any], what: str) -> Any:
    """Import ``path`` and call it with ``kwargs``; a wrong signature is a ConfigError naming it."""
    factory = import_target(path, what)
    if not callable(factory):
        raise ConfigError(f"{what}={path!r} is a {type(factory).__name__}, not a callable; point it at a function")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{what}={path!r} cannot be called with {sorted(kwargs)} ({exc}); fix the keys given "
                          f"with it in the config") from None


# ------------------------------------------------------------------------------------------------ model

def resolve_model(config: Any, model: Any) -> tuple[Any, str | None]:
    """The model object and the built-in loss kind its config names (None: inferred from the data)."""
    if model is not None:
        return model, None
    section = config.model
    if hasattr(section, "target"):
        built = call_target(section.target, section.factory_kwargs(), "model.target")
        if config.backend == "jax":
            from functrain.core.program import model_kind_of
            try:
                model_kind_of(built)
            except ConfigError as exc:
                raise ConfigError(f"model.target={section.target!r} returned: {exc}") from None
        return built, section.kind
    if hasattr(section, PYTHON_OBJECT):
        raise ConfigError(f"model.python_object={getattr(section, PYTHON_OBJECT)!r} records a model passed to fit; "
                          f"pass it again with fit(..., model=) or set model.name or model.target")
    kind = model_spec(section.name)["kind"]
    if config.backend == "torch":
        return None, kind  # the bridge builds its own registry models
    from functrain.core.precision import COMPUTE_DTYPES
    return build_model(section, COMPUTE_DTYPES[config.train.compute_dtype]), kind


# ------------------------------------------------------------------------------------------------- data

def _source(data: Any, what: str) -> Source | Stream:
    """Training data as a source, a :class:`Mixture` or a :class:`Stream`."""
    try:
        return as_data(data)
    except DataError as exc:
        raise DataError(f"{what}: {exc}") from None


def _eval_source(data: Any, what: str) -> Source:
    if is_stream(data):
        raise DataError(f"{what}: evaluation data is read whole, in order, every evaluation, so it must be random "
                        f"access (len and getitem: a dict of arrays, a datasets.Dataset); materialise it (e.g. "
                        f"datasets.Dataset.from_list(list(stream.take(n))))")
    return _source(data, what)


def mixture_from_config(section: Any, vocab_size: int | None) -> tuple[Mixture, Source | None]:
    """``data.sources`` as a :class:`Mixture` of each entry's training part, and the evaluation parts one after
    the other (each evaluation record counted once), or None when no entry has any. ``vocab_size``: the
    model's, for sources that check their token ids against it."""
    opened = [open_source(entry.path, entry.name, section, vocab_size) for entry in section.sources]
    names = [f"data.sources[{k}] ({entry.path})" for k, entry in enumerate(section.sources)]
    mixture = Mixture([(train, entry.weight) for (train, _), entry in zip(opened, section.sources)],
                      block_size=section.mixture_block_size, names=names)
    evaluation = [(part, name) for (_, part), name in zip(opened, names) if part is not None]
    if not evaluation:
        return mixture, None
    return mixture, ConcatSource([part for part, _ in evaluation], names=[name for _, name in evaluation])


def resolve_data(config: Any, train_data: Any, eval_data: Any) -> tuple[Source | Stream, Source | None]:
    """The training and evaluation data: passed, from ``data.target``, ``data.sources`` or ``data.name``."""
    if train_data is not None:
        return (_source(train_data, "train_data"),
                None if eval_data is None else _eval_source(eval_data, "eval_data"))
    section = config.data
    if section.target is not None:
        factory = import_target(section.target, "data.target")
        if inspect.isgeneratorfunction(factory):  # the function itself is the stream (reopened on resume)
            return _source(functools.partial(factory, **section.kwargs), f"data.target={section.target!r}"), None
        loaded = call_target(section.target, section.kwargs, "data.target")
        train, evaluation = loaded if isinstance(loaded, tuple) and len(loaded) == 2 else (loaded, None)
        what = f"data.target={section.target!r} returned"
        return _source(train, what), None if evaluation is None else _eval_source(evaluation, what)
    if section.sources is not None:
        return mixture_from_config(section, config.model.vocabulary_size())
    if section.name == PYTHON_OBJECT:
        raise ConfigError("data.name=python_object records data passed to fit; pass it again with "
                          "fit(..., train_data=) or set data.name or data.target")
    if section.name == "tokens":
        return token_store(section, config.model.vocabulary_size())
    if section.name == "synthetic":
        return synthetic_splits(section.seq_len, config.model.vocabulary_size(),
                                config.seed if section.seed is None else section.seed, section.eval_fraction)
    train, evaluation = load_dataset(section)
    return as_source(train), (as_source(evaluation) if len(next(iter(evaluation.values()))) else None)


# -------------------------------------------------------------------------------------------- optimizer

def resolve_optimizer(config: Any, optimizer: Any) -> tuple[Any, str] | None:
    """A user optimizer (passed or from ``optimizer.target``) with its name for errors; None: by name.

    A target that takes ``learning_rate`` (``optax:lion``) and is not given one in ``optimizer.kwargs`` is
    driven by the config's schedule; any other is called with the kwargs and returns a transformation or a
    function of the schedule."""
    if optimizer is not None:
        return optimizer, "optimizer"
    section = config.optimizer
    if section.target is None:
        return None
    what = f"optimizer.target={section.target!r}"
    factory = import_target(section.target, "optimizer.target")
    if _takes_learning_rate(factory) and "learning_rate" not in section.kwargs:
        # An optax-style constructor (optax:lion): the config's schedule becomes its learning rate.
        return (lambda schedule: factory(learning_rate=schedule, **section.kwargs)), what
    return call_target(section.target, section.kwargs, "optimizer.target"), what


def _takes_learning_rate(factory: Any) -> bool:
    try:
        return "learning_rate" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin, a class without one)
        return False


def optimizer_settings(section: Any, total_steps: int) -> OptimizerSettings:
    """The optimizer an ``optimizer`` config section names, as settings both backends build from."""
    if section.name == PYTHON_OBJECT:
        raise ConfigError("optimizer.name=python_object records an optimizer passed to fit; pass it again with "
                          "fit(..., optimizer=) or set optimizer.name or optimizer.target")
    return OptimizerSettings(section.name, schedule_settings(section, total_steps), section.weight_decay,
                             section.optax_options())


def schedule_settings(section: Any, total_steps: int) -> ScheduleSettings:
    """The learning-rate schedule of an ``optimizer`` config section (a user optimizer is driven by it too)."""
    return ScheduleSettings(section.schedule, section.learning_rate, section.warmup_steps, total_steps,
                            section.end_lr_ratio)


def make_optimizer(section: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation and its schedule for an ``optimizer`` config section."""
    settings = optimizer_settings(section, total_steps)
    schedule = settings.schedule.optax()
    return named_optimizer(settings, schedule), schedule


def resolve_transform(config: Any, transform: Transform | None) -> Transform | None:
    """The per-record transform: passed to ``fit``, or ``data.transform``; None without either."""
    if transform is None and config.data.transform is not None:
        transform = import_target(config.data.transform, "data.transform")
    if transform is not None and not callable(transform):
        raise ConfigError(f"the data transform is a {type(transform).__name__}, not a function; pass "
                          f"transform(record, rng) -> record")
    return transform


def first_record(train: Source | Stream, transform: Transform | None, seed: int) -> dict[str, np.ndarray]:
    """The training data's first record as a batch of one, transformed as the loader will."""
    example = train.gather(np.arange(1))
    return example if transform is None else apply_transform(example, transform, seed, np.arange(1))


PREFERENCE = "preference"  # data.name and Parts.kind of preference runs


def is_preference(config: Any) -> bool:
    """Whether the config trains on preference pairs (``data.name: preference``)."""
    section = config.data
    return section.name == PREFERENCE and section.target is None and section.sources is None


def preference_settings(config: Any) -> PreferenceSettings:
    """The ``preference.*`` loss settings."""
    section = config.preference
    return PreferenceSettings(section.loss_type, section.beta, section.label_smoothing, section.simpo_gamma)


def preference_parts(config: Any, model: Any, loss_fn: Callable | None, optimizer: Any) -> Parts:
    """The parts of a ``data.name: preference`` run: the pairs of ``data.path`` tokenised with
    ``data.tokenizer`` (UTF-8 bytes when unset), split by ``data.eval_fraction``, and the preference loss."""
    from functrain.text.preference import load_preference_tokenizer, preference_arrays
    section = config.data
    if loss_fn is not None:
        raise ConfigError("data.name=preference trains with the preference loss (preference.loss_type); remove "
                          "loss_fn= or use other data")
    if config.backend == "torch":
        raise ConfigError("data.name=preference (DPO and its variants) needs backend: jax; set backend=jax")
    settings = preference_settings(config)
    if config.preference.precompute_ref and not settings.uses_reference:
        raise ConfigError(f"preference.precompute_ref precomputes the reference's log-probs and "
                          f"loss_type={settings.loss_type} uses no reference; remove preference.precompute_ref")
    if not section.path:
        raise ConfigError("data.name=preference needs data.path; set data.path=PAIRS.jsonl (prompt, chosen, "
                          "rejected per line)")
    arrays, stats = preference_arrays(section.path, load_preference_tokenizer(section.tokenizer), section.seq_len,
                                      config.preference.truncation_mode)
    train, evaluation = split_records(arrays, section.eval_fraction)
    if not len(train["chosen"]):
        raise DataError(f"{section.path} has no training pairs; add pairs or lower data.eval_fraction")
    vocab = config.model.vocabulary_size()
    check = BatchCheck([FieldRule(name, upper=vocab, bound_key="model.vocab_size", what="token id")
                        for name in ("chosen", "rejected")], source=f"the data ({section.path})")
    return Parts(model=model, kind=PREFERENCE, fields=None, loss_fn=None,
                 optimizer=resolve_optimizer(config, optimizer), train_data=as_source(train),
                 eval_data=as_source(evaluation) if len(evaluation["chosen"]) else None, batch_check=check,
                 notes=tuple(stats.notes(section.path)))


def build_parts(config: Any, *, model: Any = None, loss_fn: Callable | None = None, optimizer: Any = None,
                train_data: Any = None, eval_data: Any = None, transform: Transform | None = None) -> Parts:
    """Every part of a run, from the objects given and the config for the rest."""
    if eval_data is not None and train_data is None:
        raise ConfigError("eval_data= was given without train_data=; pass both, or neither (the config's data)")
    model, kind = resolve_model(config, model)
    if train_data is None and is_preference(config):
        return preference_parts(config, model, loss_fn, optimizer)
    train, evaluation = resolve_data(config, train_data, eval_data)
    transform = resolve_transform(config, transform)
    check, fields = None, None
    mapped = config.data.fields
    if loss_fn is None or mapped.inputs is not None or mapped.labels is not None:
        example = first_record(train, transform, config.seed if config.data.seed is None else config.data.seed)
        fields = resolve_fields(example, inputs=mapped.inputs, labels=mapped.labels, kind=kind)
    if loss_fn is None:
        fields = require_builtin(fields, example)
        kind = fields.kind
        named = config.data.path or config.data.target or ("data.sources" if config.data.sources else config.data.name)
        where = "train_data" if train_data is not None else f"the data ({named})"
        check = batch_check(fields, config.model, source=where)
    return Parts(model=model, kind=kind, fields=fields, loss_fn=loss_fn, optimizer=resolve_optimizer(config, optimizer),
                 train_data=train, eval_data=evaluation, batch_check=check, transform=transform)


def check_data(parts: Parts) -> None:
    """Check what the built-in loss reads before the first step: whole in-memory arrays at once (fields, dtypes,
    ranges), other sources by the fields of their first record (their ranges are checked batch by batch)."""
    if parts.batch_check is None or parts.transform is not None:
        return  # with a transform the checked fields are its output: every batch is checked as it is read
    for source in (parts.train_data, parts.eval_data):
        arrays = getattr(source, "arrays", None)
        if arrays is not None:
            check_arrays(parts.batch_check, arrays)
        elif source is not None:
            parts.batch_check.check_fields(source.gather(np.arange(1)))
