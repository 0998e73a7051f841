"""The loop: drives a built :class:`~functrain.run.build.Run` to its end.

``drive(run)`` reads the data at a position (samples consumed), runs ``steps_per_call`` steps per compiled
call, reads each call's metrics two calls late (so the host never stalls the device queue), fires callbacks at
call boundaries, evaluates, checkpoints, and stops cleanly on SIGTERM/SIGINT with a save. It knows the
:class:`~functrain.core.backend.Backend` protocol and the run's frozen settings, nothing else: it imports no
framework and reads no config.

The order of operations that must not change:
1. the run directory is ours (its lock) before a checkpointer opens it, and the start is decided (restore or
   init) before anything is written: bad input leaves an existing run as it was; data computed from the
   starting state (the task's ``Run.start_hooks``) is filled in then, before any batch is read;
2. a call's steps are dispatched under the backend's hot-path guard; the loop looks at older calls only
   while newer ones are queued;
3. at a boundary, every call in flight is finished before an evaluation or a save, an evaluation sees the
   state of the step it reports, and a save records the data position of that same step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from typing import Any

from functrain.callbacks.base import Control
from functrain.callbacks.outcome import FitResult, StopKind, skipped_report
from functrain.callbacks.time_spent import session_time_spent
from functrain.callbacks.view import RunRecord, RunView
from functrain.checkpoint.local import LocalCheckpoints
from functrain.checkpoint.lora_saves import AdapterSaves
from functrain.guards.lock import held_for_the_job
from functrain.guards.signals import StopSignals, check_interrupted
from functrain.run.announce import announce_start
from functrain.run.build import Run
from functrain.run.call_metrics import CallMetrics
from functrain.run.evaluation import Evaluation
from functrain.run.failure import reported
from functrain.run.resume import Start, describe_source

log = logging.getLogger("functrain")

# Calls the host may dispatch before it waits for the oldest: enough queued work that the device never waits
# on a host hiccup (a log write, a callback), few enough that a stop request takes effect promptly.
CALLS_AHEAD = 2


class _Driver:
    """One run's mutable bookkeeping while :func:`drive` runs it."""

    def __init__(self, run: Run) -> None:
        self.run, self.backend, self.settings = run, run.backend, run.settings
        self.is_primary = self.backend.process_index == 0
        # Where the run stands: written here only; callbacks read it through the view.
        self.record = RunRecord(
            config=run.config,
            run_dir=run.run_dir,
            max_steps=self.settings.max_steps,
            is_primary=self.is_primary,
            time_spent=session_time_spent(run.compile_seconds),
        )
        self.view = RunView(self.record)
        self.metrics = CallMetrics(run, self.record, self.view)
        self.evaluation = Evaluation(run, self.record, self.view, self.metrics)
        self.signals = StopSignals()
        self.checkpointer: Any = None
        self.local: LocalCheckpoints | None = None  # checkpoint.local_dir
        self.adapter_saves: AdapterSaves | None = None
        self.start: Start | None = None
        self.last_meta: dict[str, Any] | None = None
        self.last_saved_step = -1
        self.at_step: int | None = None  # the step (1-based) a failure is reported at, once training began

    @contextlib.contextmanager
    def owning_run_dir(self) -> Any:
        """Hold the run directory's lock (process 0, for the whole job) while the run uses it; open the
        checkpointer only then, since opening one tidies the directory another job may be writing."""
        with held_for_the_job(self.run.run_dir, self.backend):
            try:
                self.checkpointer = self.run.open_checkpointer()
                self.local = self.run.open_local_checkpoints()
                if self.run.adapter_checkpoints:
                    self.adapter_saves = AdapterSaves(self.checkpointer)
                yield
            finally:
                if self.local is not None:
                    self.local.wait()
                if self.checkpointer is not None:
                    # Finish (or clean up) a save in flight before the directory is let go, without letting that
                    # hide an error being raised.
                    with contextlib.suppress(Exception):
                        self.checkpointer.close()

    # -- positions, saving ------------------------------------------------------------------------------------
    def update_record(self, step: int, position: int) -> None:
        self.record.step, self.record.samples_consumed = step, position
        self.record.epoch = self.run.sampler.epoch_of(position)

    def checkpoint_meta(self, step: int, position: int) -> dict[str, Any]:
        """The meta of a checkpoint of ``step``: its data position, this run's record, the metrics it reached."""
        metrics = dict(self.record.last_metrics)
        if self.evaluation.last_step != step:
            # Stale eval metrics would let a never-evaluated step outrank the evaluated one (keep-best).
            metrics = {"train": metrics["train"]} if "train" in metrics else {}
        return self.run.resume.meta(
            step,
            self.run.sampler,
            position,
            self.last_meta,
            self.started.position_jump,
            metrics,
            self.backend,
            self.started.started_from,
        )

    def save_local(self, state: Any, step: int, position: int) -> None:
        """Save this process's shards of ``state`` to its local checkpoints (written in the background)."""
        assert self.local is not None
        with self.record.time_spent.measure("save"):
            self.local.save(step, self.backend.state_to_items(state), self.checkpoint_meta(step, position))

    def save(self, state: Any, step: int, position: int) -> None:
        if step == self.last_saved_step or not self.backend.writes_checkpoints:
            return
        meta = self.checkpoint_meta(step, position)
        saver = self.adapter_saves or self.checkpointer
        with self.record.time_spent.measure("save"):
            saver.save(step, self.backend.state_to_items(state), meta)
        self.last_meta, self.last_saved_step = meta, step
        self.run.callbacks.fire("on_save", self.view, step)

    def stopped(self, kind: StopKind, reason: str) -> None:
        """How the run ended: on the record (so ``on_train_end`` sees it), then in the result."""
        self.record.stop_kind, self.record.stop_reason = kind, reason

    @property
    def started(self) -> Start:
        """The start :meth:`begin` decided (restored or fresh)."""
        assert self.start is not None, "begin() runs first"
        return self.start

    # -- the loop ----------------------------------------------------------------------------------------------
    def begin(self) -> tuple[Any, int, int]:
        """Restore or initialise; write the run's config once the start is known to be good."""
        run = self.run
        with self.record.time_spent.measure("restore"):  # or initialise
            self.start = run.resume.start(
                self.checkpointer, self.backend, run.sampler, self.adapter_saves, self.local, run.resume_experience
            )
        self.record.restore_source = self.start.source
        self.last_meta = self.start.meta
        if self.start.source == "persistent" and self.start.restored_step is not None:
            self.last_saved_step = self.start.restored_step  # a step from local copies is saved persistently again
        state, position = self.start.state, self.start.position
        step = self.backend.step_of(state)
        self.record.start_step = step
        if self.start.started_from is not None:
            self.record.started_from = describe_source(self.start.started_from)
        return state, step, position

    def announce(self, step: int, position: int) -> None:
        """The start's log lines and the run's config on disk (process 0)."""
        check_interrupted()  # a stop signal before the loop: leave the run directory as it was
        if self.is_primary:
            announce_start(self.run, self.record, self.started, step, position)

    def boundary(self, in_flight: deque, state: Any, step: int, position: int, new_epoch: bool) -> Control:
        """Everything that happens between two calls: older calls read, callbacks, signals, agreement across
        processes, then evaluation and saving on the finished state."""
        control, callbacks = Control(), self.run.callbacks
        while len(in_flight) > CALLS_AHEAD:
            control = control.merge(self.metrics.finish_call(*in_flight.popleft()))
        if new_epoch:
            control = control.merge(callbacks.fire("on_epoch_end", self.view))
            control = control.merge(callbacks.fire("on_epoch_begin", self.view))
        control = control.merge(callbacks.fire("on_step_end", self.view))
        if self.signals.received:
            control = control.merge(
                Control(
                    should_stop=True,
                    should_save=True,
                    stop_kind=StopKind.SIGNAL,
                    stop_reason=(
                        f"{self.signals.received} received: saved and stopped; run the same command again to resume"
                    ),
                )
            )
        if self.backend.process_count > 1:  # every process must take the same (collective) path
            stop, save, evaluate = self.backend.any_process(
                [control.should_stop, control.should_save, control.should_evaluate]
            )
            if stop and not control.should_stop:
                control = Control(
                    stop_kind=StopKind.OTHER_PROCESS,
                    stop_reason="another process asked to stop (a signal or a callback)",
                )
            control = dataclasses.replace(control, should_stop=stop, should_save=save, should_evaluate=evaluate)
        local_due = self.local is not None and self.settings.local_every and step % self.settings.local_every == 0
        if control.should_evaluate or control.should_save or control.should_stop or local_due:
            control = control.merge(self.metrics.finish_all(in_flight))
        if control.should_evaluate:
            control = control.merge(self.evaluation.evaluate(state))
        if control.should_save:
            self.save(state, step, position)
        elif local_due:
            self.save_local(state, step, position)
        return control

    def train(self) -> FitResult:
        state, step, position = self.begin()
        max_steps, steps_per_call = self.settings.max_steps, self.settings.steps_per_call
        if self.started.source == "persistent" and step >= max_steps:
            # Rerunning a finished job leaves its directory as it was: no config, metrics or event files.
            self.stopped(
                StopKind.ALREADY_FINISHED, f"already finished (train.max_steps={max_steps}: raise it to train further)"
            )
            return self.record.result(state, step, position, 0, self.settings.max_skipped_fraction)
        for hook in self.run.start_hooks:  # the task's: data or state parts computed from the start
            state = hook(self.backend, state, self.started.restored_step)
        self.evaluation.check_metric_names(state)
        self.update_record(step, position)
        self.announce(step, position)
        nonfinite_at_start = self.backend.nonfinite_steps_of(state)
        self.metrics.start(step, nonfinite_at_start)
        callbacks = self.run.callbacks
        self.at_step = step + 1
        callbacks.fire("on_train_begin", self.view)
        callbacks.fire("on_epoch_begin", self.view)
        in_flight: deque[tuple[int, Any, int]] = deque()  # (end step, device metrics, end position), unread
        ending = Control()  # the stop request that ends the run before its planned steps, if one does
        # Calls end on multiples of steps_per_call (where log/eval/save intervals fall), also after a resume
        # from a step that is not one (a SIGTERM save under another steps_per_call, say).
        calls = self.run.loader.iter_from(
            position,
            steps_per_call,
            num_steps=max(max_steps - step, 0),
            place=self.backend.place,
            first_call_steps=(-step) % steps_per_call or None,
        )
        with self.signals, calls:
            for batches, _, position in calls:
                with self.backend.hot_path():
                    state, metrics = self.backend.train_call(state, batches)
                step += self.metrics.dispatched(step, metrics)
                self.at_step = step  # the callbacks at the boundary run after this step
                epoch_before = self.record.epoch
                self.update_record(step, position)
                in_flight.append((step, metrics, position))
                ending = self.boundary(in_flight, state, step, position, self.record.epoch != epoch_before)
                if ending.should_stop:
                    break
                self.at_step = step + 1  # the next call's batches are read and its steps dispatched
            # The last calls are read here: a non-finite step among them stops the run as one read earlier does.
            ending = ending.merge(self.metrics.finish_all(in_flight))
        finished = not ending.should_stop
        if finished and self.evaluation.last_step != step:
            self.evaluation.evaluate(state)
        self.save(state, step, position)
        with self.record.time_spent.measure("save"):
            self.checkpointer.close()  # waits for the last save and surfaces its failure
        if finished:
            callbacks.fire("on_epoch_end", self.view)
        if not finished:
            self.stopped(ending.stop_kind, ending.stop_reason)
        elif step < max_steps:  # only a stream ends before max_steps
            self.stopped(
                StopKind.DATA_ENDED,
                f"the training data stream ended after {position} samples, before train.max_steps={max_steps}",
            )
        else:
            self.stopped(StopKind.FINISHED, "finished")
        callbacks.fire("on_train_end", self.view)
        skipped = self.backend.nonfinite_steps_of(state) - nonfinite_at_start
        result = self.record.result(state, step, position, skipped, self.settings.max_skipped_fraction)
        if self.is_primary:
            log.info("stopped at step %d (%s)", step, result.stop_reason)
            report = skipped_report(result)
            if report:
                log.warning("functrain: warning: %s", report)
        return result


def drive(run: Run) -> FitResult:
    """Train ``run`` from where its run directory stands to its end (or a stop request). User code that fails once
    training began is reported in one line (:mod:`functrain.run.failure`)."""
    driver = _Driver(run)
    try:
        with driver.owning_run_dir():
            return driver.train()
    except Exception as error:  # once training began: the progress bar closed, user code's failure in one line
        if driver.at_step is None:
            raise
        run.callbacks.fire_exception(driver.view, error)
        raise reported(error, driver.at_step, driver.checkpointer.steps()) from error
