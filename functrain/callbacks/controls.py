"""The built-in callbacks that steer a run: an evaluation and a save every N steps, and early stopping."""

import math

import numpy as np

from functrain.callbacks.base import Callback, Control
from functrain.callbacks.outcome import StopKind
from functrain.callbacks.view import RunView
from functrain.config.checks import check_metric_logged


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
