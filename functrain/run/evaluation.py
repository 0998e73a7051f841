"""Evaluating a run's state at a call boundary: the eval set's metrics (summed over every record, divided once),
then the callbacks' own (``on_evaluate``), each logged under its split; and, before the first step, the check that
the metrics early stopping and keep-best read are ones an evaluation gives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from functrain.callbacks.base import Control
from functrain.callbacks.view import RunRecord, RunView
from functrain.config.checks import check_metric_logged
from functrain.data import BatchLoader
from functrain.run.call_metrics import CallMetrics

if TYPE_CHECKING:
    from functrain.run.build import Run


class Evaluation:
    """One run's evaluations: the metrics go on the run's record, the callbacks hear of them through its view."""

    def __init__(self, run: Run, record: RunRecord, view: RunView, metrics: CallMetrics) -> None:
        """``metrics``: the reader of the run's finished calls (an eval line carries its data position fields)."""
        self.run, self.backend, self.settings = run, run.backend, run.settings
        self.record, self.view, self.metrics = record, view, metrics
        self.last_step = -1  # the step evaluated last (-1: none yet)

    def check_metric_names(self, state: Any) -> None:
        """Metrics that early stopping or keep-best read from evaluations must be ones the evaluation gives:
        found from one evaluation batch before the first step, so a typo costs no training and writes nothing."""
        wanted = [(key, metric) for key, metric in self.settings.watched_metrics if metric.startswith("eval/")]
        if not wanted or self.run.eval_loader is None:
            return
        host_batch, _ = self.run.eval_loader().host_batch(0)
        names = dict.fromkeys(self.backend.to_host(self.backend.eval_batch(state, host_batch)), 0.0)
        for key, metric in wanted:
            check_metric_logged(key, metric, "eval", names)

    def evaluate(self, state: Any) -> Control:
        """Evaluate the state: the eval metrics (when the run has eval data), then the callbacks' own
        (``on_evaluate``), each logged under its split."""
        if self.run.eval_loader is None and not self.settings.evaluate_without_data:
            return Control()
        with self.record.time_spent.measure("eval"):
            return self._evaluate(state)

    def _evaluate(self, state: Any) -> Control:
        metrics = self.eval_metrics(state, self.run.eval_loader()) if self.run.eval_loader is not None else {}
        record, callbacks = self.record, self.run.callbacks
        self.last_step = record.step
        record.state = state
        try:
            control = callbacks.fire("on_evaluate", self.view, metrics)
        finally:
            record.state = None  # donated by the next call
        reported, control = control.metrics or {}, dataclasses.replace(control, metrics=None)
        if self.run.eval_loader is not None:
            logged = {**metrics, **self.metrics.position_fields(record.samples_consumed)}
            control = control.merge(callbacks.fire("on_log", self.view, "eval", record.step, logged))
        for split, split_metrics in reported.items():
            record.last_metrics[split] = split_metrics
            control = control.merge(callbacks.fire("on_log", self.view, split, record.step, split_metrics))
        return control

    def eval_metrics(self, state: Any, loader: BatchLoader) -> dict[str, float]:
        """Sum the eval metrics over the evaluation set (every record counted once), divide once."""
        batches = loader.sampler.steps_per_epoch
        if self.settings.eval_max_batches:
            batches = min(batches, self.settings.eval_max_batches)
        totals, position = None, 0
        for _ in range(batches):
            host_batch, position = loader.host_batch(position)
            sums = self.backend.eval_batch(state, host_batch)
            totals = sums if totals is None else self.backend.add(totals, sums)
        totals = self.backend.to_host(totals)
        weight = max(float(totals["weight"]), 1e-12)
        metrics = {name: float(value) / weight for name, value in totals.items() if name != "weight"}
        metrics["weight"] = float(totals["weight"])
        if self.settings.best_metric:
            check_metric_logged("checkpoint.best_metric", self.settings.best_metric, "eval", metrics)
        self.record.last_metrics["eval"] = metrics
        return metrics
