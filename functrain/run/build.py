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
pieces (a program or module, a loss, optimizer settings, step settings), never the config. What a backend or a
task cannot honour is refused here, in one line, before anything is written.
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
from functrain.config.pipeline import pipeline_schedule, stages_as_data
from functrain.config.schema import Config
from functrain.core.backend import Backend
from functrain.core.fields import Fields, require_builtin, resolve_fields
from functrain.core.program import ModelPieces, Program
from functrain.core.step import StepSettings
from functrain.data import BatchLoader, IndexSampler, loader_for, order_for
from functrain.data.kinds import Order
from functrain.data.loader import batch_split_problem
from functrain.errors import TORCH_INSTALL, ConfigError
from functrain.models.scan import fewer_groups_unrolled, scan_groups
from functrain.parallel import determinism
from functrain.parallel.capacity import check_state_fits
from functrain.parallel.target import compiling_for
from functrain.report.events import RunEvents, history_started
from functrain.report.metrics import MetricsWriter
from functrain.report.mfu import SpeedReport, speed_report
from functrain.report.progress import ProgressBar
from functrain.report.summary import RunSummary
from functrain.report.trackers import make_trackers
from functrain.run.compile_cache import CompileReport, compile_seconds
from functrain.run.compile_cache import enable as enable_compile_cache
from functrain.run.host_memory import keep_temporaries_in_heap
from functrain.run.parts import (
    Parts,
    build_parts,
    check_data,
    data_seed,
    make_optimizer,
    optimizer_settings,
    resolve_model,
    schedule_settings,
    task_program,
)
from functrain.run.resume import ResumePolicy
from functrain.tasks.base import ExperienceStage, StartHook


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


def step_settings(config: Config) -> StepSettings:
    """The ``train`` keys the step itself reads."""
    train = config.train
    return StepSettings(
        micro_batches=train.micro_batches,
        clip_norm=train.clip_norm,
        compute_dtype=train.compute_dtype,
        matmul_precision=train.matmul_precision,
        param_dtype=train.param_dtype,
        dynamic_loss_scale=train.loss_scale == "dynamic",
        offload_optimizer=train.offload_optimizer,
    )


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


# ---------------------------------------------------------------------------------------------- backends


def check_batch_split(config: Config, ways: int, what: str) -> None:
    """The global batch must split into micro-batches over the ``ways`` the backend splits it."""
    problem = batch_split_problem(config.data.global_batch_size, config.train.micro_batches, ways, what)
    if problem:
        raise ConfigError(problem)


def jax_backend(
    config: Config,
    program: Program,
    max_steps: int,
    *,
    optimizer: tuple[Any, str] | None = None,
    devices: list | None = None,
    experience: ExperienceStage | None = None,
    compiler_options: dict[str, str] | None = None,
) -> Backend:
    """The JAX backend: the ``program`` (a task's, or :func:`functrain.core.program.as_program`'s), the optax
    transformation (``optimizer``: a user's, with its name for errors; None: the config's), the mesh over
    ``devices`` (None: all; a TPU topology's when planning), the task's experience stage (or None) and the XLA
    options of its train step (None: XLA's). Building it allocates nothing on the devices."""
    from functrain.core.optim import as_transformation
    from functrain.parallel import sharding
    from functrain.run.jax_backend import JaxBackend

    if optimizer is None:
        tx, reported = make_optimizer(config.optimizer, max_steps)
    else:
        schedule = schedule_settings(config.optimizer, max_steps).optax()
        tx, reported = as_transformation(optimizer[0], schedule, optimizer[1])
    mesh = sharding.make_mesh(config.mesh, devices)
    check_batch_split(config, sharding.batch_devices(mesh), "data-parallel devices")
    platform = next(iter(mesh.devices.flat)).platform
    pipeline = pipeline_schedule(config, sharding.batch_devices(mesh))
    return JaxBackend(
        program,
        tx,
        reported,
        mesh=mesh,
        rules=sharding.logical_rules(config.mesh),
        param_rules=config.mesh.param_rules,
        allow_replicated_fallback=config.mesh.allow_replicated_fallback,
        step=step_settings(config),
        seed=config.seed,
        experience=experience,
        compiler_options=determinism.step_compiler_options(platform, config.train.deterministic, compiler_options),
        pipeline=pipeline,
    )


def torch_backend(
    config: Config,
    example_batch: dict[str, np.ndarray],
    max_steps: int,
    *,
    model: Any = None,
    fields: Fields | None = None,
    loss_fn: Callable | None = None,
    optimizer: tuple[Any, str] | None = None,
) -> Backend:
    """The torch backend: the module (``model``, or the config's twin), its loss (``loss_fn``, or the built-in
    one for the data's ``fields``) and the optimizer's twin, or a one-line refusal of what the torch step does
    not implement."""
    try:
        from torch_bridge import backend as torch_backend_module
        from torch_bridge import distributed, optim, user_model
        from torch_bridge.twins import twin_model
    except ImportError as exc:
        raise ConfigError(f"backend: torch needs PyTorch ({exc.__cause__ or exc}); {TORCH_INSTALL}") from None
    if config.model.lora_settings() is not None:
        raise ConfigError("model.lora needs backend: jax; remove model.lora or set backend: jax")
    if optimizer is not None:
        raise ConfigError(
            f"{optimizer[1]} is an optax optimizer, which backend: torch does not run; use optimizer.name"
        )
    if config.mesh.fsdp != 1 or config.mesh.expert != 1 or config.mesh.tensor != 1:
        raise ConfigError("backend: torch shards only over data; set mesh.fsdp=1, mesh.expert=1 and mesh.tensor=1")
    distributed.init_from_env()
    check_batch_split(config, distributed.world_size(), "processes")
    builtin = model is None
    if fields is None and loss_fn is None and not builtin:
        fields = require_builtin(resolve_fields(example_batch), example_batch)
    module = twin_model(config.model, example_batch, config.seed) if builtin else user_model.trainable_module(model)
    loss = user_model.step_loss(
        module, builtin=builtin, loss_fn=loss_fn, fields=fields, torch_compile=config.train.torch_compile
    )
    return torch_backend_module.TorchBackend(
        module,
        loss,
        optim.from_settings(optimizer_settings(config.optimizer, max_steps)),
        step=step_settings(config),
        seed=config.seed,
        probe_batch=None if builtin and loss_fn is None else example_batch,
    )  # user code: tried before step 1


def backend_of(
    config: Config, parts: Parts, example_batch: dict[str, np.ndarray], max_steps: int, devices: list | None = None
) -> tuple[Backend, ModelPieces | None]:
    """The backend the config names, built from the parts, and the model's pieces its program runs (None: the
    torch twin, which runs modules)."""
    if config.backend == "torch":
        return torch_backend(
            config,
            example_batch,
            max_steps,
            model=parts.model,
            fields=parts.data.fields,
            loss_fn=parts.context.loss_fn,
            optimizer=parts.optimizer,
        ), None
    program, pieces = task_program(config, parts, example_batch)
    experience = parts.task.experience(parts.context, parts.data, pieces)
    if experience is not None and jax.process_count() > 1 and not getattr(experience, "across_processes", False):
        raise ConfigError(
            f"task {parts.task.name} makes its batches with an experience stage that runs on one process (it does "
            f"not set across_processes: functrain.tasks.base.ExperienceStage); run it on one host"
        )
    return jax_backend(
        config,
        program,
        max_steps,
        optimizer=parts.optimizer,
        devices=devices,
        experience=experience,
        compiler_options=parts.task.step_compiler_options(),
    ), pieces


# ------------------------------------------------------------------------------------------------- build


def _order(config: Config, parts: Parts) -> tuple[Order, int, dict[str, np.ndarray]]:
    """The training data's order, the run's length and its first batch (whose shapes the step is built for)."""
    data, task_data = config.data, parts.data
    records = task_data.records_per_step or data.global_batch_size
    sampler = order_for(task_data.train, records, data_seed(config), shuffle=data.shuffle, last_batch=data.last_batch)
    example_batch, _ = loader_for(task_data.train, sampler, prefetch=0, transform=task_data.transform).host_batch(0)
    if task_data.example_fields is not None:
        example_batch = task_data.example_fields(example_batch)
    return sampler, total_steps(config, sampler), example_batch


@dataclass(frozen=True)
class Planned:
    """A run's JAX backend and the shapes of its train call, built as :func:`build_run` builds them, with the
    settings a plan reports against (read from the config here, so the planner reads none)."""

    parts: Parts
    backend: Any  # JaxBackend
    example_batch: dict[str, np.ndarray]  # one global batch (host arrays: tokens, not weights)
    max_steps: int
    step: StepSettings
    steps_per_call: int
    global_batch_size: int
    seq_len: int
    model_config: Any  # the model section (its decoder shape, its remat policy)
    scan_groups: int = 0  # model.scan_layers: the whole groups of layers scanned; else 0
    # The backend of the same run (mesh, shardings, batch, step) with the model cut to ``k`` groups of layers
    # and its remainder, unrolled, each micro-batch split ``s`` ways (more micro-batches): XLA counts a loop body
    # once, so a plan measures the layers' cost from these (on a split micro-batch where a whole one is refused).
    unrolled_groups_backend: Callable[[int, int], Any] | None = None
    # The same run's backend built again (a new trace), each micro-batch split ``s`` ways: for a compile traced
    # under another context (a plan counts the cross-entropy's chunk loops unrolled, unembedding.counted_whole).
    rebuilt_backend: Callable[[int], Any] | None = None

    @property
    def tokens_per_step(self) -> int | None:
        """Tokens one step trains on (None: the task's samples are not token windows)."""
        tokens = self.parts.data.tokens_per_sample
        return None if tokens is None else tokens * self.global_batch_size


def plan_run(config: Config, devices: list | None = None) -> Planned:
    """The backend a ``train`` of ``config`` would build, over ``devices`` (None: the local ones; a TPU
    topology's for a pod that is not here), with no state initialised and nothing written or allocated."""
    if config.backend != "jax":
        raise ConfigError("functrain plan compiles the JAX step; set backend=jax")
    # Choices that depend on the hardware (model.attention=auto) are made for the devices planned for.
    with compiling_for(devices):
        parts = build_parts(config)
        check_data(parts.data)
        _, max_steps, example_batch = _order(config, parts)
        backend, _ = backend_of(config, parts, example_batch, max_steps, devices)

    def unrolled_groups_backend(groups: int, split: int = 1) -> Any:
        # A pipelined run's copies fold its stages into the data axis (functrain.plan.planner.pipelined_run_cost).
        update = {"model": fewer_groups_unrolled(config.model, groups), "mesh": stages_as_data(config.mesh)}
        return rebuilt_backend(split, config.model_copy(update=update))

    def rebuilt_backend(split: int = 1, variant: Config = config) -> Any:
        train = variant.train.model_copy(update={"micro_batches": variant.train.micro_batches * split})
        return variant_backend(variant.model_copy(update={"train": train}))

    def variant_backend(variant: Config) -> Any:
        with compiling_for(devices):
            model, _ = resolve_model(variant, None)
            program, _ = task_program(variant, parts, example_batch, model)
            options = parts.task.step_compiler_options()
            return jax_backend(
                variant, program, max_steps, optimizer=parts.optimizer, devices=devices, compiler_options=options
            )

    groups = scan_groups(config.model)
    return Planned(
        parts=parts,
        backend=backend,
        example_batch=example_batch,
        max_steps=max_steps,
        step=step_settings(config),
        steps_per_call=config.train.steps_per_call,
        global_batch_size=config.data.global_batch_size,
        seq_len=config.data.seq_len,
        model_config=config.model,
        scan_groups=groups,
        unrolled_groups_backend=unrolled_groups_backend if groups else None,
        rebuilt_backend=rebuilt_backend,
    )


def _profile_window(config: Config, max_steps: int) -> list[Callback]:
    """The profiler callback ``profile.steps`` asks for, or a one-line refusal of a window the run never reaches."""
    profile = config.profile
    if not profile.steps:
        return []
    if config.backend != "jax":
        raise ConfigError("profile.steps traces the JAX backend with jax.profiler; set backend=jax or profile.steps=0")
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
        MetricsWriter(tensorboard=tensorboard),
        RunEvents(),
        *([CompileReport(compile_cache)] if config.backend == "jax" else []),
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
    if config.backend != "jax":
        raise ConfigError("train.init_from starts a JAX run from another run's weights; set backend=jax")
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
    compile_cache = enable_compile_cache(config.run.compile_cache) if config.backend == "jax" else None
    if config.backend == "jax" and jax.default_backend() == "cpu":
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
    sampler, max_steps, example_batch = _order(config, parts)
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
    if config.backend == "torch" and parts.model is not None:  # a torch user model's shape is its own
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
        open_local_checkpoints=open_local_checkpoints,
        compile_seconds=compile_seconds if config.backend == "jax" else (lambda: 0.0),
    )
