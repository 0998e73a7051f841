"""Callbacks: the loop's events (as users know them from the HF Trainer) and the built-in callbacks.

Every event gets a read-only :class:`~functrain.run.view.RunView` (where the run stands) and may return a
:class:`Control` asking the loop to stop (with its reason), save or evaluate at the current call boundary, or,
from ``on_evaluate``, to log metrics the callback measured. Events fire at call boundaries: with
``train.steps_per_call = K``, ``on_step_end`` fires once per K steps with ``view.step`` the step reached.
"""

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from functrain.errors import ConfigError
from functrain.run.config_checks import check_metric_logged
from functrain.run.outcome import StopKind
from functrain.run.tensorboard import summary_writer
from functrain.run.view import RunView


@dataclass(slots=True)
class Control:
    """What a callback asks of the loop at the current call boundary.

    With ``should_stop``, ``stop_reason`` is the sentence the run's result carries (``FitResult.stop_reason``)
    and ``stop_kind`` how it ended (``FitResult.stop_kind``; it decides the exit status). ``metrics``, from
    ``on_evaluate`` only: ``{split: {name: value}}`` the callback measured under a split of its own
    (``harness``), which the loop logs (``on_log``) after the evaluation's.
    """

    should_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    stop_reason: str = "stopped by a callback"
    stop_kind: StopKind = StopKind.CALLBACK
    metrics: dict[str, dict[str, float]] | None = None

    def merge(self, other: "Control | None") -> "Control":
        """Any request from either side stands; of two stops, the first, unless the other has an exit status of
        its own (a signal, a non-finite step) and the first has not."""
        if other is None or not (other.should_stop or other.should_save or other.should_evaluate or other.metrics):
            return self  # the common case at a call boundary: nothing asked
        stop = (
            other
            if other.should_stop
            and (not self.should_stop or (other.stop_kind.sets_exit_status and not self.stop_kind.sets_exit_status))
            else self
        )
        return Control(
            self.should_stop or other.should_stop,
            self.should_save or other.should_save,
            self.should_evaluate or other.should_evaluate,
            stop.stop_reason,
            stop.stop_kind,
            _merged_metrics(self.metrics, other.metrics),
        )


def _merged_metrics(
    first: dict[str, dict[str, float]] | None, second: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    if not first or not second:
        return first or second
    return {split: {**first.get(split, {}), **second.get(split, {})} for split in {**first, **second}}


class Callback:
    """Base class: override the events you need. Returning None means 'no request'."""

    def on_train_begin(self, view: RunView) -> Control | None: ...
    def on_train_end(self, view: RunView) -> Control | None: ...
    def on_epoch_begin(self, view: RunView) -> Control | None: ...
    def on_epoch_end(self, view: RunView) -> Control | None: ...
    def on_step_end(self, view: RunView) -> Control | None: ...
    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> Control | None: ...
    def on_evaluate(self, view: RunView, metrics: dict[str, float]) -> Control | None: ...
    def on_save(self, view: RunView, step: int) -> Control | None: ...


class CallbackList:
    """Dispatches an event to every callback and merges their controls."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def fire(self, event: str, view: RunView, *args: Any) -> Control:
        control = Control()
        for callback in self.callbacks:
            request = getattr(callback, event)(view, *args)
            if request is not None and request.metrics and event != "on_evaluate":
                raise ConfigError(
                    f"{type(callback).__name__}.{event} returned Control(metrics=...): a callback "
                    f"logs metrics of its own from on_evaluate only"
                )
            control = control.merge(request)
        return control


class ProgressBar(Callback):
    """A tqdm bar with steps/s, ETA and the latest loss (primary process only)."""

    def __init__(self) -> None:
        self.bar: Any = None  # a tqdm bar, opened when training begins (process 0)

    def on_train_begin(self, view: RunView) -> None:
        if view.is_primary:
            from tqdm import tqdm

            self.bar = tqdm(
                total=view.max_steps,
                initial=view.step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5,
            )

    def on_step_end(self, view: RunView) -> None:
        if self.bar is not None:
            self.bar.update(view.step - self.bar.n)

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None and "loss" in metrics:
            postfix = {f"{split}_loss": f"{metrics['loss']:.4f}", "epoch": view.epoch}
            if "tokens_per_sec" in metrics:
                postfix["tok/s"] = f"{metrics['tokens_per_sec']:,.0f}"
            if "mfu" in metrics:
                postfix["mfu"] = f"{metrics['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, view: RunView) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _json_safe(value: float) -> float | None:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    return value if math.isfinite(value) else None


def set_aside_lines_after(path: Path, step: int) -> None:
    """Move records of steps after ``step`` (logged by a run that crashed after its last checkpoint) to
    ``<name>.abandoned.jsonl``, so the file holds one line of history; nothing is deleted."""
    keep: list[str] = []
    abandoned: list[str] = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            later = json.loads(line)["step"] > step
        except (ValueError, KeyError, TypeError):
            later = False
        (abandoned if later else keep).append(line)
    if not abandoned:
        return
    with open(path.with_suffix(".abandoned.jsonl"), "a") as aside:
        aside.writelines(abandoned)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


class MetricsWriter(Callback):
    """Appends every logged and evaluated metric to ``metrics.jsonl`` and TensorBoard event files."""

    def __init__(self, tensorboard: bool = True) -> None:
        self.tensorboard = tensorboard
        self.jsonl: TextIO | None = None
        self.writer: Any = None  # a tensorboardX SummaryWriter

    def on_train_begin(self, view: RunView) -> None:
        if not view.is_primary:
            return
        path = view.run_dir / "metrics.jsonl"
        if path.exists():
            set_aside_lines_after(path, view.start_step)
        self.jsonl = open(path, "a", buffering=1)  # noqa: SIM115 -- held for the run; on_train_end closes it
        if self.tensorboard:
            self.writer = summary_writer(str(view.run_dir / "tensorboard"))

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        record = {"step": step, "split": split}
        record.update({name: _json_safe(value) for name, value in metrics.items()})
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"{split}/{name}", value, step)

    def on_train_end(self, view: RunView) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class EveryNSteps(Callback):
    """Asks for an evaluation and/or a save every ``N`` steps (at call boundaries)."""

    def __init__(self, evaluate_every: int = 0, save_every: int = 0) -> None:
        self.evaluate_every = evaluate_every
        self.save_every = save_every

    def on_step_end(self, view: RunView) -> Control:
        due = lambda every: bool(every) and view.step % every == 0  # noqa: E731
        return Control(should_evaluate=due(self.evaluate_every), should_save=due(self.save_every))


class EarlyStopping(Callback):
    """Stops when ``metric`` (``"eval/loss"`` style) has not improved by ``min_delta`` for ``patience`` evals."""

    def __init__(self, metric: str, patience: int = 3, mode: str = "min", min_delta: float = 0.0) -> None:
        self.metric = metric
        self.split, _, self.name = metric.partition("/")
        self.patience, self.mode, self.min_delta = patience, mode, min_delta
        self.best = math.inf if mode == "min" else -math.inf
        self.bad_evaluations = 0

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> Control | None:
        # A metric its split never logs would never stop the run: say so at the first log of that split.
        check_metric_logged("eval.early_stopping_metric", self.metric, split, metrics)
        if split != self.split:
            return None
        value = metrics[self.name]
        if np.isfinite(value) and self._improved(value):
            self.best, self.bad_evaluations = value, 0
            return None
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            return Control(
                should_stop=True,
                stop_kind=StopKind.EARLY_STOPPED,
                stop_reason=(
                    f"early stopping: {self.split}/{self.name} did not improve for "
                    f"{self.patience} evaluations (best {self.best:.6g})"
                ),
            )
        return None


class Throughput:
    """Steps per second between log steps, from the time each call was known to be finished.

    That is when its metrics were read for an asynchronous backend (JAX), and when ``train_call`` returned
    for a synchronous one (torch on CPU), whose metrics are read one call after it finished.
    """

    def __init__(self) -> None:
        self.returned_at: dict[int, float] = {}
        self.last_logged = 0

    def mark(self, step: int) -> None:
        """The call ending at ``step`` is finished now (or the run starts at ``step``)."""
        self.returned_at[step] = time.perf_counter()

    def start(self, step: int) -> None:
        """Measure from ``step``, now."""
        self.returned_at = {}
        self.mark(step)
        self.last_logged = step

    def rate(self, step: int) -> float:
        """Steps per second from the previous log step to ``step``."""
        elapsed = self.returned_at[step] - self.returned_at[self.last_logged]
        rate = (step - self.last_logged) / max(elapsed, 1e-9)
        self.returned_at = {s: t for s, t in self.returned_at.items() if s >= step}
        self.last_logged = step
        return rate
