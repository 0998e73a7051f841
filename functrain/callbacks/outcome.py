"""How a run ended: :class:`FitResult`, the exit status the CLI returns for it, and the closing report.

Exit statuses of ``functrain train`` (also ``FitResult.exit_code``):

====  =========================================================================================
0     finished: the planned steps ran (or early stopping or a callback ended the run)
2     bad input: a config, data, checkpoint or run-directory problem (one line on stderr), or user code that failed
      during the run (:mod:`functrain.run.failure`)
3     stopped because a step was non-finite (``train.nonfinite: stop``); params are intact
4     finished, but more than ``train.max_skipped_fraction`` of its steps were skipped as non-finite:
      the model barely trained
75    stopped by SIGTERM/SIGINT after saving (EX_TEMPFAIL): run the same command again to resume
====  =========================================================================================

A preempted job therefore exits non-zero, so schedulers that restart failed jobs (Kubernetes, TorchElastic,
Slurm with ``--requeue``) restart it, and the rerun resumes from the save.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functrain.errors import (  # noqa: F401
    EXIT_BAD_INPUT,
    EXIT_FINISHED,
    EXIT_MOSTLY_SKIPPED,
    EXIT_NONFINITE,
    EXIT_SIGNAL,
    PLANNED_EXITS,
)


class StopKind(enum.Enum):
    """How a run ended (``FitResult.stop_kind``); the sentence people read is ``FitResult.stop_reason``."""

    FINISHED = "finished"  # the planned steps ran
    DATA_ENDED = "data_ended"  # the training data stream ended before train.max_steps
    ALREADY_FINISHED = "already_finished"  # rerun of a finished job: nothing trained, nothing written
    EARLY_STOPPED = "early_stopped"  # eval.early_stopping_metric stopped improving
    CALLBACK = "callback"  # a callback asked to stop
    OTHER_PROCESS = "other_process"  # another process of the job asked to stop
    NONFINITE = "nonfinite"  # a non-finite step with train.nonfinite: stop
    SIGNAL = "signal"  # SIGTERM/SIGINT: saved, to be resumed

    @property
    def sets_exit_status(self) -> bool:
        """Whether this ending has an exit status of its own: it outranks any other stop asked for at the same
        call boundary, so the status and the sentence always tell the same story."""
        return self in _EXIT_STATUS


_EXIT_STATUS = {StopKind.NONFINITE: EXIT_NONFINITE, StopKind.SIGNAL: EXIT_SIGNAL}


@dataclass
class FitResult:
    """What ``fit`` returns: the final state, where the run stopped and its last metrics.

    ``stop_reason`` says in a sentence why the run stopped, ``stop_kind`` (a :class:`StopKind`) says it for code.
    ``skipped_steps`` and ``steps_run`` count this invocation's steps (not the resumed history);
    ``exit_code`` is what ``functrain train`` exits with (see the table in :mod:`functrain.callbacks.outcome`).
    """

    state: Any
    step: int
    samples_consumed: int
    stop_reason: str
    metrics: dict[str, dict[str, float]]
    run_dir: Path
    stop_kind: StopKind = StopKind.FINISHED
    steps_run: int = 0
    skipped_steps: int = 0
    max_skipped_fraction: float = 0.5

    def __repr__(self) -> str:
        """One line, not the whole TrainState: how the run ended, its steps, its directory and the last losses and
        accuracies read (``.state`` and ``.metrics`` hold everything)."""
        shown = "".join(
            f", {split} {name} {value:.4g}"
            for split, metrics in self.metrics.items()
            for name, value in metrics.items()
            if name == "loss" or "accurac" in name
        )
        return (
            f"FitResult({self.stop_kind.value} at step {self.step}, {self.steps_run} steps run, "
            f"run_dir='{self.run_dir}'{shown})"
        )

    @property
    def skipped_fraction(self) -> float:
        """The share of this invocation's steps whose update was skipped as non-finite."""
        return self.skipped_steps / self.steps_run if self.steps_run else 0.0

    @property
    def exit_code(self) -> int:
        if self.stop_kind in _EXIT_STATUS:
            return _EXIT_STATUS[self.stop_kind]
        if self.skipped_steps and self.skipped_fraction > self.max_skipped_fraction:
            return EXIT_MOSTLY_SKIPPED
        return EXIT_FINISHED


def skipped_report(result: FitResult) -> str | None:
    """A warning about skipped steps, or None when every step updated the model."""
    if not result.skipped_steps:
        return None
    share = result.skipped_fraction
    text = (
        f"{result.skipped_steps} of {result.steps_run} steps ({share:.0%}) had a non-finite loss or gradients "
        f"and were skipped"
    )
    if share > result.max_skipped_fraction:
        return (
            f"{text}: the model barely trained (exit status {EXIT_MOSTLY_SKIPPED}); check the data (labels, "
            f"token ids), lower optimizer.learning_rate or set train.clip_norm"
        )
    return f"{text}; if this grows, lower optimizer.learning_rate or set train.clip_norm"
