"""Resolve a run's parts: the task the config trains with its data and program, and the config's names (and
the objects given to ``fit``) as objects, for the CLI, ``fit(path)`` and ``fit(config, model=..., ...)`` alike.

An object passed to ``fit`` wins; otherwise the config names it: ``model.name`` (the registry in
:mod:`functrain.models`) or ``model.target``; ``data.name`` (:mod:`functrain.data.datasets`; ``tokens``: a token
store, :mod:`functrain.data.token_windows`) or ``data.target``; ``optimizer.name`` (:mod:`functrain.core.optim`) or
``optimizer.target``. Import paths are ``"package.module:attribute"``; one that does not resolve or gives the
wrong kind of object is a one-line ConfigError naming it. :func:`functrain.run.build.build_run` then makes the
task's data and program, the backend and the rest of the run from these.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import optax

from functrain.config.model_section import PythonModelConfig, TargetModelConfig
from functrain.config.sections import PYTHON_OBJECT
from functrain.core.adapters import ModelPieces, model_pieces
from functrain.core.capabilities import capabilities_of
from functrain.core.optim import OptimizerSettings, ScheduleSettings, named_optimizer
from functrain.core.program import Program
from functrain.core.targets import import_target
from functrain.data import ConcatSource, Mixture, Source, Stream, as_data, as_source
from functrain.data.datasets import load_dataset, open_source, token_store
from functrain.data.stream import is_stream
from functrain.data.synthetic import synthetic_splits
from functrain.data.transforms import Transform
from functrain.data.validate import check_arrays
from functrain.errors import ConfigError, DataError
from functrain.models import build_model, family_named
from functrain.models.lora import lora_transform
from functrain.models.options import RuntimeOptions
from functrain.parallel.determinism import attention_choice
from functrain.parallel.target import target_platform
from functrain.tasks import task_for
from functrain.tasks.base import Task, TaskContext, TaskData

# ------------------------------------------------------------------------------------------------ the task


@dataclass(frozen=True)
class Parts:
    """What a run is built from: the task, what it was handed, its data, the model and a user optimizer.

    ``model`` is None with ``backend: torch`` and a registry model (the bridge builds it); ``optimizer`` is a
    user optimizer (transformation or function of the schedule) with what to call it in errors, or None
    (``optimizer.name``)."""

    task: Task
    context: TaskContext
    data: TaskData
    model: Any
    optimizer: tuple[Any, str] | None


def data_seed(config: Any) -> int:
    """``data.seed``, or the run's seed when it is not set."""
    return config.seed if config.data.seed is None else config.data.seed


def build_parts(
    config: Any,
    *,
    model: Any = None,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    train_data: Any = None,
    eval_data: Any = None,
    transform: Callable | None = None,
) -> Parts:
    """The task the config trains, with its data, from the objects given and the config for the rest."""
    if eval_data is not None and train_data is None:
        raise ConfigError("eval_data= was given without train_data=; pass both, or neither (the config's data)")
    model, model_kind = resolve_model(config, model)
    task = task_for(config)
    context = TaskContext(
        config=config,
        run_dir=Path(config.run.dir).absolute(),
        model=model,
        model_kind=model_kind,
        loss_fn=loss_fn,
        transform=resolve_transform(config, transform),
        data_given=train_data is not None,
        read_data=functools.partial(resolve_data, config, train_data, eval_data),
        data_seed=data_seed(config),
    )
    task.check(context)
    return Parts(
        task=task, context=context, data=task.data(context), model=model, optimizer=resolve_optimizer(config, optimizer)
    )


# ------------------------------------------------------------------------------------------------ program


def transformed(pieces: ModelPieces, config: Any, loss_fn: Callable | None) -> ModelPieces:
    """The model's pieces after the config's transforms (``model.lora``: adapters, the base frozen)."""
    lora = config.model.lora_settings()
    if lora is None:
        return pieces
    if loss_fn is not None:
        raise ConfigError("model.lora trains a registry model with its built-in loss; remove loss_fn= or model.lora")
    return lora_transform(pieces, lora)


def program_and_pieces(
    config: Any, parts: Parts, example_batch: dict[str, np.ndarray], model: Any = None
) -> tuple[Program, ModelPieces]:
    """The task's program on the model's pieces (``model``: another build of the model than the parts', for
    plans), and the pieces it was built on."""
    task, data = parts.task, parts.data
    inputs = task.model_inputs(parts.context, data, example_batch)
    argument = data.fields.argument if data.fields is not None else None
    pieces = transformed(
        model_pieces(parts.model if model is None else model, inputs, example_batch, argument),
        config,
        parts.context.loss_fn,
    )
    return task.program(parts.context, data, pieces, example_batch), pieces


# ------------------------------------------------------------------------------------------------ objects


def describe_object(obj: Any) -> str:
    """``package.module.Name`` of an object's type (of a function pair: of its ``init``), for the record."""
    if isinstance(obj, tuple) and obj and callable(obj[0]):
        obj = obj[0]
    named = obj if inspect.isfunction(obj) or isinstance(obj, type) else type(obj)
    return f"{named.__module__}.{named.__qualname__}"


def call_target(path: str, kwargs: dict[str, Any], what: str) -> Any:
    """Import ``path`` and call it with ``kwargs``; a wrong signature is a ConfigError naming it."""
    factory = import_target(path, what)
    if not callable(factory):
        raise ConfigError(f"{what}={path!r} is a {type(factory).__name__}, not a callable; point it at a function")
    try:
        return factory(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"{what}={path!r} cannot be called with {sorted(kwargs)} ({exc}); fix the keys given with it in the config"
        ) from None


# ------------------------------------------------------------------------------------------------ model


def resolve_model(config: Any, model: Any) -> tuple[Any, str | None]:
    """The model object and the built-in loss kind its config names (None: inferred from the data)."""
    if model is not None:
        return model, None
    section = config.model
    if isinstance(section, TargetModelConfig):
        built = call_target(section.target, section.factory_kwargs(), "model.target")
        if capabilities_of(config.backend).runs_programs:  # the factory's model must become a program's pieces
            from functrain.core.adapters import model_kind_of

            try:
                model_kind_of(built)
            except ConfigError as exc:
                raise ConfigError(f"model.target={section.target!r} returned: {exc}") from None
        return built, section.kind
    if isinstance(section, PythonModelConfig):
        raise ConfigError(
            f"model.python_object={section.python_object!r} records a model passed to fit; "
            f"pass it again with fit(..., model=) or set model.name or model.target"
        )
    kind = family_named(section.name).kind
    if not capabilities_of(config.backend).runs_programs:
        return None, kind  # the bridge builds its own registry models
    from functrain.core.precision import COMPUTE_DTYPES

    if isinstance(section, RuntimeOptions):
        choice = attention_choice(section.attention, target_platform(), config.train.deterministic)
        section = section.model_copy(update={"attention": choice})
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
        raise DataError(
            f"{what}: evaluation data is read whole, in order, every evaluation, so it must be random "
            f"access (len and getitem: a dict of arrays, a datasets.Dataset); materialise it (e.g. "
            f"datasets.Dataset.from_list(list(stream.take(n))))"
        )
    source = _source(data, what)
    assert not isinstance(source, Stream), "is_stream refused it above"
    return source


def mixture_from_config(section: Any, vocab_size: int | None) -> tuple[Mixture, Source | None]:
    """``data.sources`` as a :class:`Mixture` of each entry's training part, and the evaluation parts one after
    the other (each evaluation record counted once), or None when no entry has any. ``vocab_size``: the
    model's, for sources that check their token ids against it."""
    opened = [open_source(entry.path, entry.name, section, vocab_size) for entry in section.sources]
    names = [f"data.sources[{k}] ({entry.path})" for k, entry in enumerate(section.sources)]
    mixture = Mixture(
        [(train, entry.weight) for (train, _), entry in zip(opened, section.sources)],
        block_size=section.mixture_block_size,
        names=names,
    )
    evaluation = [(part, name) for (_, part), name in zip(opened, names) if part is not None]
    if not evaluation:
        return mixture, None
    return mixture, ConcatSource([part for part, _ in evaluation], names=[name for _, name in evaluation])


def resolve_data(config: Any, train_data: Any, eval_data: Any) -> tuple[Source | Stream, Source | None]:
    """The training and evaluation data: passed, from ``data.target``, ``data.sources`` or ``data.name``."""
    if train_data is not None:
        return (_source(train_data, "train_data"), None if eval_data is None else _eval_source(eval_data, "eval_data"))
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
        raise ConfigError(
            "data.name=python_object records data passed to fit; pass it again with "
            "fit(..., train_data=) or set data.name or data.target"
        )
    if section.name == "tokens":
        return token_store(section, config.model.vocabulary_size())
    if section.name == "synthetic":
        return synthetic_splits(
            section.seq_len,
            config.model.vocabulary_size(),
            config.seed if section.seed is None else section.seed,
            section.eval_fraction,
        )
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
        raise ConfigError(
            "optimizer.name=python_object records an optimizer passed to fit; pass it again with "
            "fit(..., optimizer=) or set optimizer.name or optimizer.target"
        )
    return OptimizerSettings(
        section.name, schedule_settings(section, total_steps), section.weight_decay, section.optax_options()
    )


def schedule_settings(section: Any, total_steps: int) -> ScheduleSettings:
    """The learning-rate schedule of an ``optimizer`` config section (a user optimizer is driven by it too)."""
    return ScheduleSettings(
        section.schedule, section.learning_rate, section.warmup_steps, total_steps, section.end_lr_ratio
    )


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
        raise ConfigError(
            f"the data transform is a {type(transform).__name__}, not a function; pass transform(record, rng) -> record"
        )
    return transform


def check_data(data: TaskData) -> None:
    """Check what a task's loss reads before the first step (a :class:`~functrain.tasks.base.TaskData`): whole
    in-memory arrays at once (fields, dtypes, ranges), other sources by the fields of their first record (their
    ranges are checked batch by batch)."""
    if data.batch_check is None or data.transform is not None:
        return  # with a transform the checked fields are its output: every batch is checked as it is read
    for source in (data.train, data.eval):
        arrays = getattr(source, "arrays", None)
        if arrays is not None:
            check_arrays(data.batch_check, arrays)
        elif source is not None:
            data.batch_check.check_fields(source.gather(np.arange(1)))
