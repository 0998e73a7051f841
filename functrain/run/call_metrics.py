"""Reading finished calls: their metrics, log lines, throughput and the non-finite policy.

A call's metrics stay on the device until the loop looks at the call, two calls after dispatching it. Then
the call is only awaited, unless its end is a log step (its metrics are copied and logged) or the run stops at
non-finite steps (a few bytes of flags are read, so the run stops at the first bad step). Intervals are
multiples of ``steps_per_call``, so log steps are call ends, where the data position is known exactly.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from functrain.callbacks.base import Control
from functrain.callbacks.outcome import StopKind
from functrain.callbacks.view import RunRecord, RunView
from functrain.config.checks import check_metric_logged

if TYPE_CHECKING:
    from functrain.run.build import Run


class CallMetrics:
    """Reads finished calls for one run, keeping the newest train metrics on the run's record."""

    def __init__(self, run: Run, record: RunRecord, view: RunView) -> None:
        """``record``: where the run stands (the train metrics go there); ``view``: the callbacks' view of it."""
        self.run, self.backend, self.settings = run, run.backend, run.settings
        self.record, self.view = record, view
        self.throughput = Throughput()
        # The state's non-finite count when the loop last read a call's metrics (see check_nonfinite).
        self.nonfinite_seen, self.nonfinite_checked_at = 0, 0

    def start(self, step: int, nonfinite_steps: int) -> None:
        """Measure from ``step``, now; the state has ``nonfinite_steps`` flagged steps in its history."""
        self.nonfinite_seen, self.nonfinite_checked_at = nonfinite_steps, step
        self.throughput.start(step)

    def dispatched(self, step: int, device_metrics: dict[str, Any]) -> int:
        """The number of steps of a call just dispatched from ``step`` (a synchronous backend has run it)."""
        steps = len(next(iter(device_metrics.values())))
        if self.backend.synchronous:
            self.throughput.mark(step + steps)
        return steps

    def position_fields(self, position: int) -> dict[str, int]:
        """Where the data stood, for log lines."""
        return {"epoch": self.run.sampler.epoch_of(position), "samples_consumed": position}

    def is_log_step(self, step: int) -> bool:
        return step % self.settings.log_every == 0 or step == self.settings.max_steps

    def finish_call(self, call_end_step: int, device_metrics: Any, end_position: int) -> Control:
        """Wait for a call; read and log its metrics if its end is a log step."""
        if self.is_log_step(call_end_step):
            return self.record_train(call_end_step, device_metrics, end_position)
        control = Control()
        if self.settings.stop_on_nonfinite:
            flags = self.backend.to_host({name: device_metrics[name] for name in ("nonfinite", "nonfinite_steps")})
            control = self.check_nonfinite(call_end_step, flags)
        else:
            self.backend.wait(device_metrics)
        if not self.backend.synchronous:
            self.throughput.mark(call_end_step)
        return control

    def finish_all(self, in_flight: deque) -> Control:
        """Finish every call in flight; the newest one's metrics are read even off a log step, so a save or
        an evaluation sees the metrics of the step it is at."""
        control = Control()
        while len(in_flight) > 1:
            control = control.merge(self.finish_call(*in_flight.popleft()))
        if in_flight:
            control = control.merge(self.record_train(*in_flight.popleft()))
        return control

    def record_train(self, call_end_step: int, device_metrics: Any, end_position: int) -> Control:
        """Materialise a finished call's metrics; log its last step if that is a log boundary. A non-finite
        step is noticed here: at the next log, save, eval or stop (its update was skipped, so nothing is lost
        by the wait)."""
        metrics = self.backend.to_host(device_metrics)
        if not self.backend.synchronous:
            self.throughput.mark(call_end_step)
        steps = len(next(iter(metrics.values())))
        control = self.check_nonfinite(call_end_step, metrics)
        values = {name: float(series[steps - 1]) for name, series in metrics.items()}
        self.record.last_metrics["train"] = values
        if self.is_log_step(call_end_step):
            steps_per_sec = self.throughput.rate(call_end_step)
            values = {
                **values,
                "steps_per_sec": steps_per_sec,
                **self.run.speed.fields(steps_per_sec),
                **self.position_fields(end_position),
            }
            if self.settings.best_metric:
                check_metric_logged("checkpoint.best_metric", self.settings.best_metric, "train", values)
            control = control.merge(self.run.callbacks.fire("on_log", self.view, "train", call_end_step, values))
        return control

    def check_nonfinite(self, call_end_step: int, metrics: dict[str, np.ndarray]) -> Control:
        """With ``train.nonfinite: stop``, a stop request naming the first non-finite step of a finished call
        (its per-step ``nonfinite`` flags and the state's cumulative ``nonfinite_steps``). Of several, the
        first request stands (:meth:`Control.merge`): the earliest incident is the one named."""
        steps = len(metrics["nonfinite"])
        nonfinite_steps = int(metrics["nonfinite_steps"][-1])
        control = Control()
        if self.settings.stop_on_nonfinite and nonfinite_steps > self.nonfinite_seen:
            # The cumulative count also catches incidents in calls whose flags were never read.
            flagged = np.flatnonzero(metrics["nonfinite"])
            where = (
                f"at step {call_end_step - steps + 1 + int(flagged[0])}"
                if len(flagged)
                else f"between steps {self.nonfinite_checked_at} and {call_end_step - steps}"
            )
            control = Control(
                should_stop=True,
                stop_kind=StopKind.NONFINITE,
                stop_reason=(
                    f"non-finite loss or gradients {where} (update skipped, params intact); "
                    f"lower optimizer.learning_rate or set train.clip_norm"
                ),
            )
        self.nonfinite_seen, self.nonfinite_checked_at = nonfinite_steps, call_end_step
        return control


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
