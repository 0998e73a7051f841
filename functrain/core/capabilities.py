"""What each backend can do, declared once: the config's checks, the builder and the tasks ask a capability
(``capabilities_of(config.backend).pipeline``), never a backend's name, and name in their one-line refusals the
backends that have it (:func:`backends_with`).

A record imports nothing of its framework: ``backend: torch`` is declared here, and the bridge is imported only
when a run builds it. A new backend is one record more in :data:`BACKENDS` (and its builder in
:mod:`functrain.run.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BackendCapabilities:
    """One backend's capabilities; each field names the settings and parts of a run that need it."""

    name: str  # the config's ``backend``, and the one its checkpoints record
    # A task's Program on the model's pieces (functrain's own models, or linen, NNX and functions from
    # model.target): every task, with its experience stage and start hooks. Without it the backend builds its own
    # twins of the registry's models and trains modules with the built-in loss or the user's.
    runs_programs: bool
    # The step is a JAX program compiled by XLA: the persistent compilation cache (run.compile_cache) and its
    # report, compile seconds in the goodput, jax.profiler traces (profile.steps), XLA:CPU's temporaries kept in
    # the heap, and functrain plan.
    compiles_with_xla: bool
    context_parallel: bool  # mesh.context > 1: each sequence split over devices
    pipeline: bool  # mesh.pipeline > 1: the scanned layers split into stages
    param_dtype: bool  # train.param_dtype other than float32: the parameters stored in lower precision
    offload_optimizer: bool  # train.offload_optimizer: the optimizer state in pinned host memory
    fp8: bool  # train.fp8: the models' projections as FP8 products
    local_checkpoints: bool  # checkpoint.local_dir: each process's shards on its own fast storage
    starts_from_weights: bool  # train.init_from: another run's weights, a fresh optimizer
    decodes_in_loop: bool  # eval.samples, eval.harness_tasks: the current weights decode and score text
    torch_compile: bool  # train.torch_compile: the training forward through torch.compile
    # A user's model object tells its decoder shape (for MFU) through its own attributes (HF-style modules).
    reads_user_model_shape: bool


BACKENDS: dict[str, BackendCapabilities] = {
    "jax": BackendCapabilities(
        name="jax",
        runs_programs=True,
        compiles_with_xla=True,
        context_parallel=True,
        pipeline=True,
        param_dtype=True,
        offload_optimizer=True,
        fp8=True,
        local_checkpoints=True,
        starts_from_weights=True,
        decodes_in_loop=True,
        torch_compile=False,
        reads_user_model_shape=False,
    ),
    "torch": BackendCapabilities(
        name="torch",
        runs_programs=False,
        compiles_with_xla=False,
        context_parallel=False,
        pipeline=False,
        param_dtype=False,
        offload_optimizer=False,
        fp8=False,
        local_checkpoints=False,
        starts_from_weights=False,
        decodes_in_loop=False,
        torch_compile=True,
        reads_user_model_shape=True,
    ),
}


def capabilities_of(backend: str) -> BackendCapabilities:
    """The capabilities of the backend named ``backend`` (a config's, validated against :data:`BACKENDS`)."""
    return BACKENDS[backend]


def backends_with(capability: str) -> tuple[str, ...]:
    """The names of the backends that have ``capability`` (a field of :class:`BackendCapabilities`), in
    :data:`BACKENDS`' order: for refusals that name where a setting works."""
    return tuple(name for name, capabilities in BACKENDS.items() if getattr(capabilities, capability))
