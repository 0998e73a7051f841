"""The backend a config names, built from a run's parts: the JAX backend (a task's program on a mesh) or the torch
twin's, each given built pieces, never the config; or a one-line refusal of what that backend cannot honour."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from functrain.config.pipeline import pipeline_schedule
from functrain.config.schema import Config
from functrain.core.adapters import ModelPieces
from functrain.core.backend import Backend
from functrain.core.capabilities import capabilities_of
from functrain.core.fields import Fields, require_builtin, resolve_fields
from functrain.core.program import Program
from functrain.core.step import StepSettings
from functrain.data.loader import batch_split_problem
from functrain.errors import TORCH_INSTALL, ConfigError
from functrain.parallel import determinism
from functrain.run.parts import Parts, make_optimizer, optimizer_settings, program_and_pieces, schedule_settings
from functrain.tasks.base import ExperienceStage


def step_settings(config: Config) -> StepSettings:
    """The ``train`` keys the step itself reads."""
    train = config.train
    return StepSettings(
        micro_batches=train.micro_batches,
        clip_norm=train.clip_norm,
        compute_dtype=train.compute_dtype,
        matmul_precision=train.matmul_precision,
        param_dtype=train.param_dtype,
        fp8=train.fp8,
        dynamic_loss_scale=train.loss_scale == "dynamic",
        offload_optimizer=train.offload_optimizer,
    )


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
    if not capabilities_of(config.backend).runs_programs:  # the torch twin: modules and a loss, no program
        return torch_backend(
            config,
            example_batch,
            max_steps,
            model=parts.model,
            fields=parts.data.fields,
            loss_fn=parts.context.loss_fn,
            optimizer=parts.optimizer,
        ), None
    program, pieces = program_and_pieces(config, parts, example_batch)
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
        compiler_options=parts.task.step_compiler_options(parts.context),
    ), pieces
