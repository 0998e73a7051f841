"""The run a plan compiles: its JAX backend and the shapes of its train call, built by the builder as ``functrain
train`` builds them, with no state initialised and nothing written or allocated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from functrain.config.schema import Config
from functrain.core.capabilities import backends_with, capabilities_of
from functrain.core.step import StepSettings
from functrain.errors import ConfigError
from functrain.models.scan import scan_groups
from functrain.parallel.target import compiling_for
from functrain.run.backends import backend_of, step_settings
from functrain.run.build import training_order
from functrain.run.parts import Parts, build_parts, check_data


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
        scan_groups=scan_groups(config.model),
    )
