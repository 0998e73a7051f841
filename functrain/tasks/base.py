"""What a training mode is made of: a :class:`Task`, and what the builder hands it.

A task owns one mode end to end: its typed config section (named after it), how its data becomes batches
(:meth:`Task.data`), its :class:`~functrain.core.program.Program` built on the model's pieces
(:meth:`Task.program`), hooks that run once the run's start is known (:meth:`Task.start_hooks`) and, for modes that
make their training batches with the current weights (rollouts), an :class:`ExperienceStage`. The builder
(:func:`functrain.run.build.build_run`) calls these in a fixed order and never asks which task it holds:

    task = tasks.task_for(config)              # by name, or what the config implies
    data = task.data(context)                  # sources, checks, field roles
    pieces = transforms(model_pieces(model))   # the model adapted (linen, NNX, functions), then LoRA
    program = task.program(context, data, pieces, example_batch)
    backend = JaxBackend(program, ...)         # or the torch twin, for tasks that run there
    hooks = task.start_hooks(context, data, pieces)   # run by the loop once the start is decided

Writing one: subclass :class:`Task`, write its loss as a :class:`~functrain.core.program.TaskLoss` and declare it
(:class:`~functrain.tasks.declaration.TaskDeclaration`: in its folder's ``__init__.py``, through the entry point group
``functrain.tasks`` from a package of one's own, or at run time with :func:`functrain.tasks.register_task`);
``docs/tasks.md`` walks through an example.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol

import numpy as np

from functrain.core.adapters import ModelPieces
from functrain.core.capabilities import backends_with
from functrain.core.fields import Fields
from functrain.core.program import Program
from functrain.data import Source, Stream
from functrain.data.transforms import Transform
from functrain.data.validate import BatchCheck
from functrain.errors import ConfigError


@dataclass(frozen=True)
class TaskContext:
    """What a task may read while the run is built.

    Attributes:
      config: the validated run config (a task reads its own section, ``config.data``, ``config.train``, ...).
      run_dir: the run directory (absolute); nothing may be written there while building.
      model: the model object (None with ``backend: torch`` and a registry model: the bridge builds it).
      model_kind: the built-in loss the model's config names (a registry model's, ``model.kind``), or None.
      loss_fn: a user loss passed to ``fit``, or None.
      transform: the per-record transform (``fit(transform=)`` / ``data.transform``), or None.
      data_given: whether ``fit`` was given ``train_data`` (the config's data section is then not read).
      read_data: the data as the config (or ``fit``) gives it: ``(train, eval)`` sources from ``data.name`` /
        ``data.target`` / ``data.sources`` or the objects passed; tasks with data of their own never call it.
      data_seed: ``data.seed``, or the run's seed.
    """

    config: Any
    run_dir: Path
    model: Any
    model_kind: str | None
    loss_fn: Callable | None
    transform: Transform | None
    data_given: bool
    read_data: Callable[[], tuple[Source | Stream, Source | None]]
    data_seed: int


@dataclass(frozen=True)
class TaskData:
    """A task's data, ready for the loaders.

    Attributes:
      train, eval: the sources (eval None: no evaluation data): checked before the first step, and the first
        batch of ``train`` is the one the step is built for.
      batch_check: what the task's loss reads, checked on every batch (None: a user loss reads the batch).
      fields: the roles of the data's fields (:mod:`functrain.core.fields`), or None where the task reads fixed
        fields of its own.
      transform: the per-record transform the loaders apply, or None.
      notes: warnings found while reading the data, shown when the run starts.
      tokens_per_sample: tokens one sample trains on (throughput, MFU); None when samples are not token windows.
      example_fields: fields the step's batches carry beyond the sources' (their shapes, for building the step):
        ``example_fields(batch) -> batch`` adds them to a host batch; None: none.
      loader_train, loader_eval: what the loaders read when it is not ``train`` / ``eval`` themselves (the same
        records with fields a start hook fills in); None: the sources.
      records_per_step: the records one step reads when they are not ``data.global_batch_size`` (GRPO: the
        prompts, each sampled ``num_generations`` times by the experience stage); None: the global batch.
    """

    train: Source | Stream
    eval: Source | None
    batch_check: BatchCheck | None = None
    fields: Fields | None = None
    transform: Transform | None = None
    notes: tuple[str, ...] = ()
    tokens_per_sample: int | None = None
    example_fields: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None
    loader_train: Source | None = None
    loader_eval: Source | None = None
    records_per_step: int | None = None


class StartHook(Protocol):
    """Runs once the start is decided (a restore or a fresh init), before any batch is read:
    ``hook(backend, state, restored_step) -> state`` (``restored_step`` None on a fresh start). It may return a
    state with task-held parts filled in (a teacher's weights) or fill data computed from the starting weights
    (precomputed reference log-probs) and return the state as it was."""

    def __call__(self, backend: Any, state: Any, restored_step: int | None) -> Any: ...


class ExperienceStage(Protocol):
    """Turns the data's batch into the training batch with the current weights, between the loader and the step
    (rollouts: sample completions with the policy, score them on the host): ``stage(params, batch, key, step) ->
    batch``. ``key`` derives from the run's seed and ``step`` (the step the batch trains), so an experience batch
    is a pure function of (weights, data position, step) and a resumed run stays bitwise equal to one that never
    stopped.

    ``batch`` holds this process's rows (the loader's slice) and the stage returns the training batch's rows of this
    process. A stage that works so on many processes (its device work on the params' mesh, as
    :class:`functrain.tasks.sampling.Sampler` does, and anything computed over the whole batch gathered from every
    process) sets ``across_processes = True``; a multi-process run of any other stage is refused in one line.

    A stage that keeps a running total (GRPO's ``num_tokens``) may also have ``logged(step) -> {name: value}``, the
    values of the step just made that are logged as they are, beside the step's metrics (exact: they never pass
    through the device, whose float32 rounds a count above 2**24), and ``resume(meta)``, called when a run resumes
    with the meta of the restored checkpoint (whose train metrics hold those values at its step).

    A stage that samples ahead (asynchronous GRPO, :mod:`functrain.tasks.grpo.ahead`) sets ``ahead`` to k > 0 and
    has ``take(step) -> batch | None`` (the batch made earlier for ``step``; None: none, the stage's ``__call__``
    makes it), ``make_ahead(params, batch, key_of, step)`` (called once the step is dispatched: the batches of the
    steps up to ``step + k`` from the loader's ``batch``, the key of step ``t`` being ``key_of(t)``), and for the
    checkpoint's ``experience`` item ``saved_ahead() -> [batch]``, ``ahead_example() -> batch`` (a whole batch's
    shapes) and ``restore_ahead(step, [batch])``."""

    across_processes: bool

    def __call__(self, params: Any, batch: dict[str, Any], key: Any, step: int) -> dict[str, Any]: ...


class Task:
    """One training mode (see the module docstring). Subclasses set :attr:`name` and override what differs."""

    name: ClassVar[str]
    # The backends the task trains on, the others refused in one line (check): by default those that run a task's
    # Program; a task whose loss both twins build sets every backend.
    backends: ClassVar[tuple[str, ...]] = backends_with("runs_programs")
    # Whether a user ``loss_fn`` may replace the task's loss.
    takes_loss_fn: ClassVar[bool] = False

    def step_compiler_options(self, context: TaskContext) -> dict[str, str] | None:
        """XLA options the JAX train step is compiled with (default: None, XLA's own)."""
        return None

    def data(self, context: TaskContext) -> TaskData:
        """The task's data (default: the config's or ``fit``'s data as it is, no check)."""
        train, evaluation = context.read_data()
        return TaskData(train=train, eval=evaluation, transform=context.transform)

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        """What the model is called on in ``example_batch`` (a linen model is initialised on it)."""
        raise NotImplementedError(f"task {self.name!r} names no model inputs")

    def program(
        self, context: TaskContext, data: TaskData, pieces: ModelPieces, example_batch: dict[str, np.ndarray]
    ) -> Program:
        """The task's loss on the model's pieces (JAX backend)."""
        raise NotImplementedError(f"task {self.name!r} defines no program")

    def start_hooks(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> list[StartHook]:
        """Hooks run once the start is decided (default: none); ``pieces``: the model's, as the program has them."""
        return []

    def experience(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> ExperienceStage | None:
        """The stage that makes training batches with the current weights (default: none; the loader's batch is
        the training batch); ``pieces``: the model's, as the program has them."""
        return None

    def check(self, context: TaskContext) -> None:
        """Refuse, in one line, what the task cannot train: another backend, a user loss it does not take."""
        config = context.config
        if config.backend not in self.backends:
            raise ConfigError(
                f"task {self.name} runs on backend {' or '.join(self.backends)}; set backend={self.backends[0]}"
            )
        if context.loss_fn is not None and not self.takes_loss_fn:
            raise ConfigError(f"task {self.name} trains with its own loss; remove loss_fn= or choose another task")
