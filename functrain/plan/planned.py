"""The run a plan compiles: its JAX backend and the shapes of its train call, built by the builder as ``functrain
train`` builds them, with no state initialised and nothing written or allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from functrain.config.pipeline import stages_as_data
from functrain.config.schema import Config
from functrain.core.capabilities import backends_with, capabilities_of
from functrain.core.step import StepSettings
from functrain.errors import ConfigError
from functrain.models.scan import fewer_groups_unrolled, scan_groups
from functrain.parallel.target import compiling_for
from functrain.run.backends import backend_of, jax_backend, step_settings
from functrain.run.build import training_order
from functrain.run.parts import Parts, build_parts, check_data, program_and_pieces, resolve_model


@dataclass(frozen=True)
class Planned:
    """A run's JAX backend and the shapes of its train call, built as :func:`~functrain.run.build.build_run` builds
    them, with the settings a plan reports against (read from the config here, so the planner reads none)."""

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
    if not capabilities_of(config.backend).compiles_with_xla:
        raise ConfigError(f"functrain plan compiles the JAX step; set backend={backends_with('compiles_with_xla')[0]}")
    # Choices that depend on the hardware (model.attention=auto) are made for the devices planned for.
    with compiling_for(devices):
        parts = build_parts(config)
        check_data(parts.data)
        _, max_steps, example_batch = training_order(config, parts)
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
            program, _ = program_and_pieces(variant, parts, example_batch, model)
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
