"""Where a run stands: the loop's own record of it (:class:`RunRecord`) and the read-only view of that record
every callback event gets (:class:`RunView`).

Only the loop writes the record. The view reads through to it, so it is current at every event and costs
nothing to keep so; assigning to it raises. What a callback sends back (a stop and its reason, metrics it
measured) travels in the :class:`~functrain.callbacks.base.Control` it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, NoReturn

from functrain.callbacks.outcome import FitResult, StopKind
from functrain.callbacks.time_spent import TimeSpent


@dataclass(slots=True)
class RunRecord:
    """Where the run stands, written by the loop (and the reader of its finished calls) only."""

    config: Any
    run_dir: Path
    max_steps: int
    is_primary: bool
    step: int = 0
    epoch: int = 0
    samples_consumed: int = 0
    start_step: int = 0
    started_from: str | None = None  # the run (and step) whose weights this one began with (train.init_from)
    stop_kind: StopKind | None = None  # set when the run stops, before on_train_end
    stop_reason: str | None = None
    last_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    state: Any = None  # the train state during on_evaluate, else None (the next call donates it)
    time_spent: TimeSpent = field(default_factory=lambda: TimeSpent(lambda: 0.0))  # restore, eval, save, compile
    restore_source: str | None = None  # where the start came from: local, peer or persistent (None: fresh)

    def result(
        self, state: Any, step: int, position: int, skipped_steps: int, max_skipped_fraction: float
    ) -> FitResult:
        """What ``fit`` returns once the run stopped (:attr:`stop_kind` and :attr:`stop_reason` set) at ``step``."""
        assert self.stop_kind is not None and self.stop_reason is not None, "the run stopped first"
        return FitResult(
            state=state,
            step=step,
            samples_consumed=position,
            stop_reason=self.stop_reason,
            metrics=dict(self.last_metrics),
            run_dir=self.run_dir,
            stop_kind=self.stop_kind,
            steps_run=step - self.start_step,
            skipped_steps=skipped_steps,
            max_skipped_fraction=max_skipped_fraction,
        )


class RunView:
    """Read-only facts about the run, current at every event. Assigning to it raises AttributeError: a
    callback asks the loop for something by returning a :class:`~functrain.callbacks.base.Control`."""

    __slots__ = ("_record",)
    _record: RunRecord  # set once, by __init__ (object.__setattr__: the view's own __setattr__ raises)

    def __init__(self, record: RunRecord) -> None:
        object.__setattr__(self, "_record", record)

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(
            f"the run view is read-only (callbacks cannot set view.{name}); return a Control "
            f"from the event instead: Control(should_stop=True, stop_reason='...') to stop, "
            f"Control(metrics={{split: {{...}}}}) from on_evaluate to log metrics"
        )

    def __delattr__(self, name: str) -> NoReturn:
        self.__setattr__(name, None)

    @property
    def config(self) -> Any:
        """The run's resolved config."""
        return self._record.config

    @property
    def run_dir(self) -> Path:
        """The run directory."""
        return self._record.run_dir

    @property
    def max_steps(self) -> int:
        """The step the run trains to (``train.max_steps`` or the epochs')."""
        return self._record.max_steps

    @property
    def is_primary(self) -> bool:
        """Whether this is process 0, the one that writes logs and files."""
        return self._record.is_primary

    @property
    def step(self) -> int:
        """The step reached (at a call boundary: the last step of the call)."""
        return self._record.step

    @property
    def epoch(self) -> int:
        """The epoch the data position is in."""
        return self._record.epoch

    @property
    def samples_consumed(self) -> int:
        """The data position: training samples consumed so far."""
        return self._record.samples_consumed

    @property
    def start_step(self) -> int:
        """The step this session started from (0, or the restored checkpoint's)."""
        return self._record.start_step

    @property
    def started_from(self) -> str | None:
        """The run and step whose weights this run began with (``train.init_from``: ``runs/a at step 500``), else
        None; kept across resumes."""
        return self._record.started_from

    @property
    def stop_kind(self) -> StopKind | None:
        """How the run ended (from ``on_train_end``), else None."""
        return self._record.stop_kind

    @property
    def stop_reason(self) -> str | None:
        """Why the run ended, as a sentence (from ``on_train_end``), else None."""
        return self._record.stop_reason

    @property
    def last_metrics(self) -> Mapping[str, Mapping[str, float]]:
        """The newest metrics of each split read so far (``{"train": {...}, "eval": {...}}``)."""
        return MappingProxyType(
            {split: MappingProxyType(metrics) for split, metrics in self._record.last_metrics.items()}
        )

    @property
    def time_spent(self) -> Mapping[str, float]:
        """Seconds this session spent restoring, evaluating, saving and compiling so far (see
        :mod:`functrain.callbacks.time_spent`)."""
        return MappingProxyType(self._record.time_spent.totals())

    @property
    def session_started(self) -> float:
        """When this session began (seconds since the epoch): its process's start, for the first ``fit`` of a
        process."""
        return self._record.time_spent.started

    @property
    def restore_source(self) -> str | None:
        """Where this session's start came from: ``local`` (this process's local checkpoint), ``peer`` (a
        process's local checkpoint sent from another), ``persistent``; None for a fresh start."""
        return self._record.restore_source

    @property
    def state(self) -> Any:
        """The train state during ``on_evaluate`` (to score or sample with its params), else None."""
        return self._record.state
