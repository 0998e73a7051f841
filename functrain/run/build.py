"""Build a run once: a resolved config plus any objects the caller passed become a :class:`Run`.

A fixed sequence that never asks which task it builds (:func:`build_run`):

1. the parts: the model (``model.name`` / ``model.target`` / ``fit``'s), the task by name
   (:func:`functrain.tasks.task_for`), the task's data, the optimizer;
2. the order of the data, the run's length and the first batch the step is built for;
3. the program: the model's pieces, transformed (LoRA), then the task's loss on them; the backend from it;
4. the loaders, the checkpointer, the resume policy with the starting weights (``train.init_from``), the task's
   start hooks, the callbacks.

Every name -> object lookup happens here, in :mod:`functrain.run.parts` or in a task: the loop
(:func:`functrain.run.loop.drive`) takes the built Run and reads no config, and each backend receives built
pieces (a program or module, a loss, optimizer settings, step settings; :mod:`functrain.run.backends`), never the
config. What a backend or a task cannot honour is refused here, in one line, before anything is written.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from functrain.callbacks.base import Callback, CallbackList
from functrain.callbacks.controls import EarlyStopping, EveryNSteps
from functrain.checkpoint import Checkpointer
from functrain.checkpoint.local import LocalCheckpoints
from functrain.config.checks import likely_mistakes
from functrain.config.schema import Config
from functrain.core.backend import Backend
from functrain.core.capabilities import backends_with, capabilities_of
from functrain.data import BatchLoader, IndexSampler, loader_for, order_for
from functrain.data.kinds import Order
from functrain.errors import ConfigError
from functrain.parallel.capacity import check_state_fits
from functrain.report.events import RunEvents, history_started
from functrain.report.metrics import MetricsWriter
from functrain.report.mfu import SpeedReport, speed_report
from functrain.report.progress import ProgressBar
from functrain.report.summary import RunSummary
from functrain.report.trackers import make_trackers
from functrain.run.backends import backend_of
from functrain.run.compile_cache import CompileReport, compile_seconds
from functrain.run.compile_cache import enable as enable_compile_cache
from functrain.run.host_memory import keep_temporaries_in_heap
from functrain.run.parts import (
    Parts,
    build_parts,
    check_data,
    data_seed,
    optimizer_settings,
)
from functrain.run.resume import ResumePolicy
from functrain.tasks.base import StartHook


@dataclass(frozen=True)
class Settings:
    """The few values the loop needs, frozen at build time."""

    max_steps: int
    steps_per_call: int
    log_every: int
    stop_on_nonfinite: bool  # train.nonfinite: stop
    max_skipped_fraction: float
    eval_max_batches: int | None
    best_metric: str | None  # checkpoint.best_metric when keep_best is on
    watched_metrics: tuple[tuple[str, str], ...]  # (key, metric) that early stopping / keep-best read
    evaluate_without_data: bool = False  # callbacks evaluate on their own (eval.harness_tasks) without eval data
    local_every: int = 0  # checkpoint.local_every_steps (0: no local checkpoints)


@dataclass(frozen=True)
class Run:
    """Everything one run is made of; :func:`functrain.run.loop.drive` trains it.

    ``config`` travels only to the callbacks' view and the run directory's ``config.yaml``; ``parts`` is
    what was resolved (the task, its data, the model); the checkpointer is opened by the loop once the run
    directory's lock is held (opening one tidies the directory)."""

    config: Config
    config_record: dict[str, Any]
    settings: Settings
    parts: Parts
    run_dir: Path
    sampler: Order
    loader: Any
    eval_loader: Callable[[], BatchLoader] | None
    optimizer: Any  # OptimizerSettings, or the user's optimizer object
    backend: Backend
    open_checkpointer: Callable[[], Checkpointer]
    adapter_checkpoints: bool  # LoRA: the base weights once, then adapters only
    callbacks: CallbackList
    resume: ResumePolicy
    speed: SpeedReport
    warnings: tuple[str, ...]
    # The task's hooks, run in order once the start is known and before any batch is read (see StartHook).
    start_hooks: tuple[StartHook, ...] = ()
    # The task's experience stage's ``resume`` (ExperienceStage: optional), handed the restored checkpoint's meta.
    resume_experience: Callable[[dict[str, Any]], None] | None = None
    # This process's local checkpoints (checkpoint.local_dir), opened with the checkpointer; None: none.
    open_local_checkpoints: Callable[[], LocalCheckpoints | None] = lambda: None
    # Seconds this process has compiled so far (the goodput report keeps compiling apart from what it interrupts).
    compile_seconds: Callable[[], float] = lambda: 0.0


def total_steps(config: Config, sampler: Order) -> int:
    """``train.max_steps`` when set (it wins over epochs, as in the HF Trainer), else ``train.epochs`` of steps."""
    if config.train.max_steps is not None:
        return config.train.max_steps
    if config.train.epochs is None:
        raise ConfigError("the run has no length; set train.max_steps or train.epochs")
    return max(1, int(np.ceil(config.train.epochs * sampler.steps_per_epoch)))


def loop_settings(config: Config, max_steps: int) -> Settings:
    best_metric = config.checkpoint.best_metric if config.checkpoint.keep_best else None
    watched = tuple(
        (key, metric)
        for key, metric in (
            ("eval.early_stopping_metric", config.eval.early_stopping_metric),
            ("checkpoint.best_metric", best_metric),
        )
        if metric
    )
    return Settings(
        max_steps=max_steps,
        steps_per_call=config.train.steps_per_call,
        log_every=config.log.every_steps,
        stop_on_nonfinite=config.train.nonfinite == "stop",
        max_skipped_fraction=config.train.max_skipped_fraction,
        eval_max_batches=config.eval.max_batches,
        best_metric=best_metric,
        watched_metrics=watched,
        evaluate_without_data=bool(config.eval.harness_tasks),
        local_every=config.checkpoint.local_every_steps,
    )


def training_order(config: Config, parts: Parts) -> tuple[Order, int, dict[str, np.ndarray]]:
    """The training data's order, the run's length and its first batch (whose shapes the step is built for)."""
    data, task_data = config.data, parts.data
    records = task_data.records_per_step or data.global_batch_size
    sampler = order_for(task_data.train, records, data_seed(config), shuffle=data.shuffle, last_batch=data.last_batch)
    example_batch, _ = loader_for(task_data.train, sampler, prefetch=0, transform=task_data.transform).host_batch(0)
    if task_data.example_fields is not None:
        example_batch = task_data.example_fields(example_batch)
    return sampler, total_steps(config, sampler), example_batch


def _profile_window(config: Config, max_steps: int) -> list[Callback]:
    """The profiler callback ``profile.steps`` asks for, or a one-line refusal of a window the run never reaches."""
    profile = config.profile
    if not profile.steps:
        return []
    if not capabilities_of(config.backend).compiles_with_xla:
        tracing = backends_with("compiles_with_xla")
        raise ConfigError(
            f"profile.steps traces the JAX backend with jax.profiler; set backend={tracing[0]} or profile.steps=0"
        )
    if profile.start_step >= max_steps:
        raise ConfigError(
            f"profile.start_step={profile.start_step} is past the end of the run ({max_steps} steps); "
            f"set profile.start_step below {max_steps}"
        )
    from functrain.run.profile import ProfileWindow

    return [ProfileWindow(profile.start_step, profile.steps)]


def _callbacks(
    config: Config,
    parts: Parts,
    trackers: list[Callback],
    extra: list[Callback],
    max_steps: int,
    compile_cache: Path | None,
) -> CallbackList:
    """The built-in callbacks the config asks for, the user's, then the summary (it reads what the others
    wrote and closed)."""
    tensorboard = config.log.tensorboard and "tensorboard" in config.log.trackers
    builtins: list[Callback] = [
        EveryNSteps(config.eval.every_steps, config.checkpoint.every_steps),
        RunEvents(),  # before the metrics writer: a resume records how far metrics.jsonl got (the goodput's)
        MetricsWriter(tensorboard=tensorboard),
        *([CompileReport(compile_cache)] if capabilities_of(config.backend).compiles_with_xla else []),
        *trackers,
        *_profile_window(config, max_steps),
    ]
    if config.eval.harness_tasks:
        from functrain.report.harness_eval import HarnessEvaluation

        evaluation = config.eval
        builtins.append(
            HarnessEvaluation(
                evaluation.harness_tasks,
                evaluation.harness_include_path,
                evaluation.harness_limit,
                evaluation.harness_batch_size,
                evaluation.harness_tokenizer,
                config.model,
                config.backend,
            )
        )
    if config.eval.samples.count:
        from functrain.report.samples import SampleWriter

        builtins.append(SampleWriter(config.eval.samples, config.model, config.backend, tensorboard))
    if config.log.progress:
        builtins.append(ProgressBar())
    if config.eval.early_stopping_metric:
        builtins.append(
            EarlyStopping(
                config.eval.early_stopping_metric,
                config.eval.early_stopping_patience,
                config.eval.early_stopping_mode,
                config.eval.early_stopping_min_delta,
            )
        )
    summary = RunSummary(tokens_per_sample=parts.data.tokens_per_sample, plot=config.log.plot)
    return CallbackList(builtins + list(extra) + [summary])


def _initial_state(config: Config) -> Callable[[Backend], Any] | None:
    """How a run with ``train.init_from`` gets its first state (when it has no checkpoint of its own), or None."""
    if not config.train.init_from:
        return None
    path = Path(config.train.init_from).absolute()
    if not (path / "checkpoints").is_dir():
        raise ConfigError(
            f"{config.given_as('train.init_from')}={config.train.init_from!r} holds no checkpoints/; "
            f"train that run first (configs/dpo_char_gpt.yaml starts from `make train`'s runs/char_gpt) "
            f"or fix the path"
        )
    if not capabilities_of(config.backend).starts_from_weights:
        starting = backends_with("starts_from_weights")
        raise ConfigError(f"train.init_from starts a JAX run from another run's weights; set backend={starting[0]}")
    from functrain.run.init_from import initial_state_from

    return functools.partial(initial_state_from, path)


def _local_checkpoints(
    config: Config, run_dir: Path, adapter_checkpoints: bool
) -> Callable[[], LocalCheckpoints | None]:
    """How the loop opens this process's local checkpoints (``checkpoint.local_dir``)."""
    checkpoint = config.checkpoint
    if checkpoint.local_dir is None:
        return lambda: None
    if adapter_checkpoints:
        raise ConfigError(
            "checkpoint.local_dir saves the whole state, a LoRA run's checkpoints its adapters; remove local_dir"
        )
    return functools.partial(
        LocalCheckpoints,
        checkpoint.local_dir,
        run_dir,
        checkpoint.local_keep,
        functools.partial(history_started, run_dir),
    )


def build_run(
    config: Config,
    *,
    model: Any = None,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    train_data: Any = None,
    eval_data: Any = None,
    callbacks: list[Callback] | None = None,
    transform: Callable | None = None,
) -> Run:
    """The Run of a resolved config, with any objects given in place of the config's (see
    :func:`functrain.fit` for what each may be)."""
    capabilities = capabilities_of(config.backend)
    compile_cache = enable_compile_cache(config.run.compile_cache) if capabilities.compiles_with_xla else None
    if capabilities.compiles_with_xla and jax.default_backend() == "cpu":
        keep_temporaries_in_heap()
    parts = build_parts(
        config,
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        train_data=train_data,
        eval_data=eval_data,
        transform=transform,
    )
    trackers = make_trackers(config.log.trackers)  # before anything is read or written: a missing package
    run_dir = parts.context.run_dir  # absolute: Orbax needs absolute paths
    check_data(parts.data)  # what the task's loss reads, before the first step (and again on every batch)
    data, task_data = config.data, parts.data
    sampler, max_steps, example_batch = training_order(config, parts)
    backend, pieces = backend_of(config, parts, example_batch, max_steps)
    from functrain.run.jax_backend import JaxBackend

    if isinstance(backend, JaxBackend):  # refused from shapes, in seconds: a state too large hangs in its allocation
        check_state_fits(backend.abstract_state, backend.state_shardings, backend.mesh)
    train_source = task_data.train if task_data.loader_train is None else task_data.loader_train
    eval_source = task_data.eval if task_data.loader_eval is None else task_data.loader_eval
    loader = loader_for(
        train_source,
        sampler,
        backend.process_index,
        backend.process_count,
        prefetch=data.prefetch,
        check=task_data.batch_check,
        transform=task_data.transform,
    )
    eval_loader = None
    if eval_source is not None:

        def eval_loader() -> BatchLoader:
            """The evaluation set in a fixed order, padded so that every record counts once."""
            order = IndexSampler(
                len(eval_source), data.global_batch_size, data_seed(config), shuffle=False, last_batch="pad"
            )
            return BatchLoader(
                eval_source,
                order,
                backend.process_index,
                backend.process_count,
                prefetch=0,
                check=task_data.batch_check,
                transform=task_data.transform,
            )

    checkpoint = config.checkpoint
    open_checkpointer = functools.partial(
        Checkpointer,
        run_dir,
        keep=checkpoint.keep,
        keep_best=checkpoint.keep_best,
        best_metric=checkpoint.best_metric,
        best_mode=checkpoint.best_mode,
        async_save=checkpoint.async_save,
        on_error=checkpoint.on_error,
        is_primary=backend.process_index == 0,
    )
    open_local_checkpoints = _local_checkpoints(config, run_dir, pieces is not None and pieces.adapter_checkpoints)
    resume = ResumePolicy(
        run_dir,
        checkpoint.resume,
        data.ignore_skip,
        data.skip_samples,
        data_seed(config),
        config.backend,
        config.optimizer.model_dump(mode="json"),
        {"config_digest": config.digest(), "model": config.model.model_dump(mode="json")},
        initial_state=_initial_state(config),
    )
    if parts.model is not None and capabilities.reads_user_model_shape:  # a torch user model's shape is its own
        from torch_bridge.user_model import decoder_shape as module_shape

        shape = module_shape(parts.model)
    else:
        shape = config.model.decoder_shape()
    speed = speed_report(shape, task_data.tokens_per_sample, data.global_batch_size, backend.devices)
    optimizer = parts.optimizer[0] if parts.optimizer is not None else optimizer_settings(config.optimizer, max_steps)
    hooks = tuple(parts.task.start_hooks(parts.context, task_data, pieces)) if pieces is not None else ()
    return Run(
        config=config,
        config_record=config.to_dict(),
        settings=loop_settings(config, max_steps),
        parts=parts,
        run_dir=run_dir,
        sampler=sampler,
        loader=loader,
        eval_loader=eval_loader,
        optimizer=optimizer,
        backend=backend,
        open_checkpointer=open_checkpointer,
        adapter_checkpoints=pieces is not None and pieces.adapter_checkpoints,
        callbacks=_callbacks(config, parts, trackers, callbacks or [], max_steps, compile_cache),
        resume=resume,
        speed=speed,
        warnings=(*likely_mistakes(config, max_steps, has_eval_data=task_data.eval is not None), *task_data.notes),
        start_hooks=hooks,
        resume_experience=getattr(backend.experience, "resume", None) if isinstance(backend, JaxBackend) else None,
        open_local_checkpoints=open_local_checkpoints,
        compile_seconds=compile_seconds if capabilities.compiles_with_xla else (lambda: 0.0),
    )
