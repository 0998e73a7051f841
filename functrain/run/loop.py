"""The loop: the imperative shell around the pure step.

``fit(config)`` reads the data at a position (samples consumed), runs ``train.steps_per_call`` steps per
compiled call, reads each call's metrics two calls late (so the host never stalls the device queue), fires
callbacks at call boundaries, evaluates, checkpoints, and stops cleanly on SIGTERM/SIGINT with a save.
It does not know which framework computes a step: a backend does (``functrain.run.jax_backend.JaxBackend``, or the
torch bridge's with ``backend: torch``).
"""

import contextlib
import logging
import os
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
import yaml

from functrain.run.build import Parts, build_parts, check_data, describe_object, make_backend
from functrain.run.callbacks import (Callback, CallbackList, Control, EarlyStopping, EveryNSteps, MetricsWriter,
                                 ProgressBar, RunView, Throughput)
from functrain.checkpoint import Checkpointer, list_checkpoints
from functrain.run.config import PYTHON_OBJECT, Config, load_config, override_list
from functrain.run.config_checks import check_metric_logged, likely_mistakes
from functrain.data import BatchLoader, IndexSampler, check_resume, data_meta, loader_for, order_for, resume_position
from functrain.data.kinds import Order
from functrain.errors import CheckpointError, ConfigError
from functrain.run.events import RunEvents
from functrain.run.lora_saves import AdapterSaves
from functrain.run.mfu import speed_report
from functrain.run.outcome import (ALREADY_FINISHED, EARLY_STOPPED, FINISHED, NONFINITE, SIGNAL, FitResult,
                               skipped_report)
from functrain.run.lock import RunLock
from functrain.run.samples import SampleWriter
from functrain.run.summary import RunSummary
from functrain.run.trackers import make_trackers

log = logging.getLogger("functrain")

# Calls the host may dispatch before it waits for the oldest: enough queued work that the device never waits
# on a host hiccup (a log write, a callback), few enough that a stop request takes effect promptly.
CALLS_AHEAD = 2


def resolve_config(config: Config | dict | str | os.PathLike, overrides: dict[str, Any]) -> Config:
    """A validated Config from a Config, a dict or a YAML path, with ``{"train.max_steps": 5}`` overrides
    (``train__max_steps=5`` works too, for keyword arguments)."""
    dotted = override_list({key.replace("__", "."): value for key, value in overrides.items()})
    if isinstance(config, Config):
        return load_config(base=config.to_dict(), overrides=dotted)
    if isinstance(config, dict):
        return load_config(base=config, overrides=dotted)
    return load_config(config, dotted)


def total_steps(config: Config, sampler: Order) -> int:
    """``train.max_steps`` when set (it wins over epochs, as in the HF Trainer), else ``train.epochs`` of steps."""
    if config.train.max_steps is None and config.train.epochs is None:
        raise ConfigError("the run has no length; set train.max_steps or train.epochs")
    if config.train.max_steps is not None:
        return config.train.max_steps
    return max(1, int(np.ceil(config.train.epochs * sampler.steps_per_epoch)))


def write_run_config(run_dir: Path, config: Config) -> None:
    """Write the resolved config atomically; a different earlier config is kept beside it, never lost."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run.dir {str(run_dir)!r} ({exc.strerror}); choose another run.dir") from None
    target = run_dir / "config.yaml"
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if target.exists() and target.read_text() != text:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(target.stat().st_mtime))
        target.replace(run_dir / f"config.{stamp}.yaml")
    tmp = run_dir / f".config.yaml.tmp-{os.getpid()}"
    tmp.write_text(text)
    tmp.replace(target)


class StopSignals:
    """Turns SIGTERM/SIGINT into a request to save and stop at the next call boundary.

    A second SIGINT interrupts at once (the usual escape hatch when a step hangs).
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


def _summarise_call(metrics: dict[str, np.ndarray], index: int) -> dict[str, float]:
    """Host floats of step ``index`` of a materialised call."""
    return {name: float(values[index]) for name, values in metrics.items()}


class _Run:
    """One run's mutable bookkeeping; ``fit`` drives it. Kept private: the public surface is ``fit``."""

    def __init__(self, config: Config, parts: Parts, callbacks: list[Callback]) -> None:
        self.config = config
        trackers = make_trackers(config.log.trackers)  # before anything is read or written: a missing package
        self.run_dir = Path(config.run.dir).absolute()  # Orbax needs absolute paths
        self.signals = StopSignals()

        train_data, self.eval_data = parts.train_data, parts.eval_data
        # What the model reads is checked before the first step, and again on every batch as it is built.
        self.batch_check = parts.batch_check
        check_data(parts)
        self.data_seed = config.seed if config.data.seed is None else config.data.seed
        # The order of the training data: an IndexSampler, a mixture's or a stream's (functrain.data.kinds).
        self.sampler = order_for(train_data, config.data.global_batch_size, self.data_seed,
                                 shuffle=config.data.shuffle, last_batch=config.data.last_batch)
        self.max_steps = total_steps(config, self.sampler)
        example_batch, _ = loader_for(train_data, self.sampler, prefetch=0).host_batch(0)
        self.backend = make_backend(config, parts, example_batch, self.max_steps)
        # jax.distributed or torch.distributed: the backend knows which process this is.
        self.process_index = getattr(self.backend, "process_index", jax.process_index())
        self.process_count = getattr(self.backend, "process_count", jax.process_count())
        self.is_primary = self.process_index == 0
        self.synchronous_backend = getattr(self.backend, "synchronous", False)
        # Orbax writes a checkpoint with every jax process; torch ranks hold replicas, so rank 0 writes alone.
        self.writes_checkpoints = self.is_primary or jax.process_count() > 1
        self.loader = loader_for(train_data, self.sampler, self.process_index, self.process_count,
                                 prefetch=config.data.prefetch, check=self.batch_check)
        self.checkpointer: Checkpointer | None = None  # opened once the run directory is ours (owning_run_dir)
        self.adapter_saves: AdapterSaves | None = None  # a LoRA run's: the frozen base weights saved once

        tensorboard = config.log.tensorboard and "tensorboard" in config.log.trackers
        builtins: list[Callback] = [EveryNSteps(config.eval.every_steps, config.checkpoint.every_steps),
                                    MetricsWriter(tensorboard=tensorboard), RunEvents(), *trackers]
        if config.eval.samples.count:
            builtins.append(SampleWriter(config))
        if config.log.progress:
            builtins.append(ProgressBar())
        if config.eval.early_stopping_metric:
            builtins.append(EarlyStopping(config.eval.early_stopping_metric, config.eval.early_stopping_patience,
                                          config.eval.early_stopping_mode, config.eval.early_stopping_min_delta))
        # The summary comes last: it reads what the other callbacks wrote and closed.
        summary = RunSummary(tokens_per_sample=config.data.seq_len if parts.kind == "causal_lm" else None)
        self.callbacks = CallbackList(builtins + list(callbacks) + [summary])
        self.view = RunView(config=config, run_dir=self.run_dir, max_steps=self.max_steps,
                            is_primary=self.is_primary)
        self.meta: dict[str, Any] | None = None
        self.position_jump: dict[str, int] | None = None  # where skip_samples/ignore_skip moved the data
        self.last_saved_step = -1
        self.last_eval_step = -1
        self.throughput = Throughput()
        # A torch user model's shape is its own (a transformers model's config), not the config's model section.
        shape_source = getattr(parts.model, "config", None) if config.backend == "torch" and parts.model is not None \
            else config.model
        self.speed = speed_report(shape_source, parts.kind, config.data.global_batch_size, config.data.seq_len,
                                  jax.devices() if config.backend == "jax" else [])
        # The state's non-finite count when the loop last read a call's metrics (see check_nonfinite).
        self.nonfinite_seen, self.nonfinite_checked_at = 0, 0
        self.restored = False
        self.stop_kind = FINISHED

    # -- the run directory ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def owning_run_dir(self) -> Any:
        """Hold the run directory's lock (process 0, for the whole job) while the run uses it; open the
        checkpointer only then, since opening one tidies the directory another job may be writing."""
        lock, failure = RunLock(self.run_dir) if self.is_primary else None, None
        if lock is not None:
            try:
                lock.acquire()
            except ConfigError as exc:
                failure = exc
        try:
            if self.process_count > 1 and self.backend.any_process([failure is not None])[0] and failure is None:
                raise ConfigError(f"process 0 could not take the lock of run directory {self.run_dir}; "
                                  f"see its message")
            if failure is not None:
                raise failure
            config = self.config
            self.checkpointer = Checkpointer(
                self.run_dir, keep=config.checkpoint.keep, keep_best=config.checkpoint.keep_best,
                best_metric=config.checkpoint.best_metric, best_mode=config.checkpoint.best_mode,
                async_save=config.checkpoint.async_save, on_error=config.checkpoint.on_error,
                is_primary=self.is_primary)
            if getattr(config.model, "lora", None) is not None:
                self.adapter_saves = AdapterSaves(self.checkpointer)
            yield self
        finally:
            if self.checkpointer is not None:
                # Finish (or clean up) a save in flight before the directory is let go, without letting
                # that hide an error being raised.
                with contextlib.suppress(Exception):
                    self.checkpointer.close()
            if lock is not None:
                lock.release()

    # -- state and position -------------------------------------------------------------------------------
    def restore_or_init(self) -> tuple[Any, int]:
        """The starting state and data position: from the newest whole checkpoint, or fresh."""
        request = self.resume_request()
        self.check_saved_run_fits(request)
        restored = self.checkpointer.restore(self.backend.restore_targets(), step=request)
        data = self.config.data
        if restored is None:
            return self.backend.init_state(), resume_position(None, data.ignore_skip, data.skip_samples)
        items, self.meta, step = restored
        self.restored = True
        if self.adapter_saves is not None:
            self.adapter_saves.restored(self.meta, step)
        self.check_saved_run_fits(request, self.meta, step)
        # ignore_skip / skip_samples act once: a restart after a checkpoint that already applied them
        # (the same command rerun after a preemption) continues from that checkpoint's position.
        ignore_skip, skip_samples = data.ignore_skip, data.skip_samples
        if self.meta.get("data_override") == self.data_override():
            ignore_skip, skip_samples = False, None
        check_resume(self.meta, self.sampler.num_records, self.data_seed, ignore_skip, skip_samples)
        state = self.backend.state_from_items(items)
        self.last_saved_step = step
        position = resume_position(self.meta, ignore_skip, skip_samples)
        # A mixture continues its data schedule, a stream its saved state (no-ops for plain data).
        self.sampler.restore(None if ignore_skip else self.meta, position)
        saved_position = int(self.meta.get("samples_consumed", 0))
        if position != saved_position:
            self.position_jump = {"step": step, "from": saved_position, "to": position}
        return state, position

    def check_saved_run_fits(self, request: str | int, meta: dict | None = None, step: int | None = None) -> None:
        """Name what changed when the checkpoint to resume from was written by another backend or optimizer
        (their states do not carry over), before a restore would fail on mismatched structures.
        ``meta``/``step``: of the checkpoint restored; None: of the one the request points at."""
        if meta is None:
            if request == "never":
                return
            candidates = [info for info in list_checkpoints(self.run_dir, verify=False)
                          if info.whole and info.meta and (request == "auto" or info.step == request)]
            if not candidates:
                return
            meta, step = candidates[-1].meta, candidates[-1].step
        where = f"checkpoint {step} in {self.run_dir}"
        saved_backend = meta.get("backend", "jax")
        if saved_backend != self.config.backend:
            raise CheckpointError(f"{where} was written by backend {saved_backend}, this run uses backend "
                                  f"{self.config.backend} (their states differ); set backend={saved_backend} or "
                                  f"use a new run.dir")
        saved_optimizer = (meta.get("optimizer") or {}).get("name")
        if saved_optimizer is not None and saved_optimizer != self.config.optimizer.name:
            raise CheckpointError(f"{where} holds {saved_optimizer} optimizer state but this run sets "
                                  f"optimizer.name={self.config.optimizer.name} (the optimizer state does not carry "
                                  f"over); set optimizer.name={saved_optimizer} or use a new run.dir")

    def resume_request(self) -> str | int:
        """``checkpoint.resume``, except that a step request acts once: when a newer checkpoint was written
        by a run started from that request (the same command rerun after a preemption), resume ``auto``."""
        request = self.config.checkpoint.resume
        if isinstance(request, int):
            newest = [info for info in list_checkpoints(self.run_dir, verify=False) if info.whole]
            if newest and newest[-1].step > request and (newest[-1].meta or {}).get("resume_request") == request:
                return "auto"
        return request

    def data_override(self) -> dict[str, Any]:
        """The one-time data position settings of this run, recorded in its checkpoints."""
        return {"ignore_skip": self.config.data.ignore_skip, "skip_samples": self.config.data.skip_samples}

    def update_view(self, step: int, position: int) -> None:
        self.view.step, self.view.samples_consumed = step, position
        self.view.epoch = self.sampler.epoch_of(position)

    # -- metrics, evaluation, saving -----------------------------------------------------------------------
    def is_log_step(self, step: int) -> bool:
        return step % self.config.log.every_steps == 0 or step == self.max_steps

    def finish_call(self, call_end_step: int, device_metrics: Any, end_position: int) -> Control:
        """Wait for a call; read and log its metrics if its end is a log step. With ``train.nonfinite:
        stop`` every call's per-step flags are read (a few bytes), so the run stops at the first bad step."""
        if self.is_log_step(call_end_step):
            return self.record_train(call_end_step, device_metrics, end_position)
        control = Control()
        if self.config.train.nonfinite == "stop":
            flags = self.backend.to_host({name: device_metrics[name] for name in ("nonfinite", "nonfinite_steps")})
            control = self.check_nonfinite(call_end_step, flags)
        else:
            self.backend.wait(device_metrics)
        if not self.synchronous_backend:
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
        """Materialise a finished call's metrics; log its last step if that is a log boundary.

        Intervals are multiples of ``steps_per_call``, so log steps are call ends, where the data position
        is known exactly. A non-finite step is noticed here: at the next log, save, eval or stop (its update
        was skipped, so nothing is lost by the wait).
        """
        metrics = self.backend.to_host(device_metrics)
        if not self.synchronous_backend:
            self.throughput.mark(call_end_step)
        steps = len(next(iter(metrics.values())))
        control = self.check_nonfinite(call_end_step, metrics)
        values = _summarise_call(metrics, steps - 1)
        self.view.last_metrics["train"] = values
        if self.is_log_step(call_end_step):
            steps_per_sec = self.throughput.rate(call_end_step)
            values = {**values, "steps_per_sec": steps_per_sec, **self.speed.fields(steps_per_sec),
                      **self.position_fields(end_position)}
            if self.config.checkpoint.keep_best:
                check_metric_logged("checkpoint.best_metric", self.config.checkpoint.best_metric, "train", values)
            control = control.merge(self.callbacks.fire("on_log", self.view, "train", call_end_step, values))
        return control

    def check_nonfinite(self, call_end_step: int, metrics: dict[str, np.ndarray]) -> Control:
        """With ``train.nonfinite: stop``, a stop request naming the first non-finite step of a finished call
        (its per-step ``nonfinite`` flags and the state's cumulative ``nonfinite_steps``)."""
        steps = len(metrics["nonfinite"])
        nonfinite_steps = int(metrics["nonfinite_steps"][-1])
        control = Control()
        if (self.config.train.nonfinite == "stop" and nonfinite_steps > self.nonfinite_seen
                and self.stop_kind != NONFINITE):  # the first incident is the one to name
            # The cumulative count also catches incidents in calls whose flags were never read.
            flagged = np.flatnonzero(metrics["nonfinite"])
            where = (f"at step {call_end_step - steps + 1 + int(flagged[0])}" if len(flagged)
                     else f"between steps {self.nonfinite_checked_at} and {call_end_step - steps}")
            self.view.stop_reason = (f"non-finite loss or gradients {where} (update skipped, params intact); "
                                     f"lower optimizer.learning_rate or set train.clip_norm")
            self.stop_kind = NONFINITE
            control = Control(should_stop=True)
        self.nonfinite_seen, self.nonfinite_checked_at = nonfinite_steps, call_end_step
        return control

    def position_fields(self, position: int) -> dict[str, int]:
        """Where the data stood, for log lines."""
        return {"epoch": self.sampler.epoch_of(position), "samples_consumed": position}

    def eval_loader(self) -> BatchLoader:
        """The evaluation set in a fixed order, padded so that every record counts once."""
        sampler = IndexSampler(len(self.eval_data), self.config.data.global_batch_size,
                               self.data_seed, shuffle=False, last_batch="pad")
        return BatchLoader(self.eval_data, sampler, self.process_index, self.process_count, prefetch=0,
                           check=self.batch_check)

    def check_eval_metric_names(self, state: Any) -> None:
        """Metrics that early stopping or keep-best read from evaluations must be ones the evaluation gives:
        found from one evaluation batch before the first step, so a typo costs no training and writes
        nothing. (Train-split names are checked at the first log.)"""
        wanted = [(key, metric) for key, metric in (
            ("eval.early_stopping_metric", self.config.eval.early_stopping_metric),
            ("checkpoint.best_metric", self.config.checkpoint.best_metric if self.config.checkpoint.keep_best
             else None)) if metric and metric.startswith("eval/")]
        if not wanted or not self.has_eval_data():
            return
        host_batch, _ = self.eval_loader().host_batch(0)
        names = dict.fromkeys(self.backend.to_host(self.backend.eval_batch(state, host_batch)), 0.0)
        for key, metric in wanted:
            check_metric_logged(key, metric, "eval", names)

    def evaluate(self, state: Any) -> Control:
        """Sum the eval metrics over the evaluation set (every record counted once), divide once."""
        if not self.has_eval_data():
            return Control()
        loader = self.eval_loader()
        sampler = loader.sampler
        batches = sampler.steps_per_epoch
        if self.config.eval.max_batches:
            batches = min(batches, self.config.eval.max_batches)
        totals, position = None, 0
        for _ in range(batches):
            host_batch, position = loader.host_batch(position)
            sums = self.backend.eval_batch(state, host_batch)
            totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        totals = self.backend.to_host(totals)
        weight = max(float(totals["weight"]), 1e-12)
        metrics = {name: float(value) / weight for name, value in totals.items() if name != "weight"}
        metrics["weight"] = float(totals["weight"])
        if self.config.checkpoint.keep_best:
            check_metric_logged("checkpoint.best_metric", self.config.checkpoint.best_metric, "eval", metrics)
        self.view.last_metrics["eval"] = metrics
        self.last_eval_step = self.view.step
        self.view.state = state
        control = self.callbacks.fire("on_evaluate", self.view, metrics)
        self.view.state = None  # donated by the next call
        logged = {**metrics, **self.position_fields(self.view.samples_consumed)}
        return control.merge(self.callbacks.fire("on_log", self.view, "eval", self.view.step, logged))

    def save(self, state: Any, step: int, position: int) -> None:
        if step == self.last_saved_step or not self.writes_checkpoints:
            return
        metrics = dict(self.view.last_metrics)
        if self.last_eval_step != step:
            # Stale eval metrics would let a never-evaluated step outrank the evaluated one (keep-best).
            metrics.pop("eval", None)
        meta = {"step": step, **data_meta(self.sampler, position, self.meta, self.position_jump),
                "config_digest": self.config.digest(), "model": self.config.model.model_dump(mode="json"),
                "backend": self.config.backend, "optimizer": self.config.optimizer.model_dump(mode="json"),
                "metrics": metrics, "time": time.time(),
                "layout": self.backend.describe(), "processes": self.process_count,
                "data_override": self.data_override(),
                "resume_request": self.config.checkpoint.resume if isinstance(self.config.checkpoint.resume, int)
                else None}
        if self.adapter_saves is not None:
            self.adapter_saves.save(step, self.backend.state_to_items(state), meta)
        else:
            self.checkpointer.save(step, self.backend.state_to_items(state), meta)
        self.meta, self.last_saved_step = meta, step
        self.callbacks.fire("on_save", self.view, step)

    # -- the loop ------------------------------------------------------------------------------------------
    def result(self, state: Any, step: int, position: int, stop_reason: str, skipped_steps: int) -> FitResult:
        return FitResult(state=state, step=step, samples_consumed=position, stop_reason=stop_reason,
                         metrics=dict(self.view.last_metrics), run_dir=self.run_dir, stop_kind=self.stop_kind,
                         steps_run=step - self.view.start_step, skipped_steps=skipped_steps,
                         max_skipped_fraction=self.config.train.max_skipped_fraction)

    def run(self) -> FitResult:
        state, position = self.restore_or_init()
        step = self.backend.step_of(state)
        self.view.start_step = step
        if self.restored and step >= self.max_steps:
            # Rerunning a finished job leaves its directory as it was: no config, metrics or event files.
            self.stop_kind = ALREADY_FINISHED
            reason = f"already finished (train.max_steps={self.max_steps}: raise it to train further)"
            return self.result(state, step, position, reason, 0)
        self.check_eval_metric_names(state)
        if self.is_primary:  # only now: bad input must not replace the config of an existing run
            if self.restored:
                log.info("resumed from checkpoint %d (epoch %d, samples consumed %d)", step,
                         self.sampler.epoch_of(position), position)
            write_run_config(self.run_dir, self.config)
            for warning in likely_mistakes(self.config, self.max_steps, has_eval_data=self.has_eval_data()):
                log.warning("functrain: warning: %s", warning)
        nonfinite_at_start = self.backend.nonfinite_steps_of(state)
        self.nonfinite_seen, self.nonfinite_checked_at = nonfinite_at_start, step
        self.update_view(step, position)
        if self.is_primary:
            records = self.sampler.num_records
            log.info("run %s: steps %d -> %d, epoch %d, samples consumed %d, %s\n%s",
                     self.run_dir, step, self.max_steps, self.view.epoch, position,
                     "streamed training data" if records is None else f"{records} training records",
                     self.backend.describe())
            if self.speed.flops_per_token:
                log.info("model FLOPs per token (training, causal attention): %.4g", self.speed.flops_per_token)
        self.callbacks.fire("on_train_begin", self.view)
        self.callbacks.fire("on_epoch_begin", self.view)
        self.throughput.start(step)
        in_flight: deque[tuple[int, Any, int]] = deque()  # (end step, device metrics, end position), unread
        stop_reason = "finished"
        steps_per_call = self.config.train.steps_per_call
        # Calls end on multiples of steps_per_call (where log/eval/save intervals fall), also after a resume
        # from a step that is not one (a SIGTERM save under another steps_per_call, say).
        with self.signals, self.loader.iter_from(position, steps_per_call, num_steps=max(self.max_steps - step, 0),
                                                 place=self.backend.place,
                                                 first_call_steps=(-step) % steps_per_call or None) as calls:
            for batches, _, end_position in calls:
                state, metrics = self.backend.train_call(state, batches)
                step += len(next(iter(metrics.values())))
                if self.synchronous_backend:
                    self.throughput.mark(step)
                epoch_before = self.view.epoch
                self.update_view(step, end_position)
                position = end_position
                # Look at older calls only now, while newer ones are queued on the device: their metrics are
                # copied to the host when they are logged, otherwise they are only awaited. The host stays at
                # most CALLS_AHEAD calls ahead, so a slow callback or a log write never idles the device.
                in_flight.append((step, metrics, end_position))
                control = Control()
                while len(in_flight) > CALLS_AHEAD:
                    control = control.merge(self.finish_call(*in_flight.popleft()))
                if self.view.epoch != epoch_before:
                    control = control.merge(self.callbacks.fire("on_epoch_end", self.view))
                    control = control.merge(self.callbacks.fire("on_epoch_begin", self.view))
                control = control.merge(self.callbacks.fire("on_step_end", self.view))
                if self.signals.received:
                    self.view.stop_reason = (f"{self.signals.received} received: saved and stopped; run the same "
                                             f"command again to resume")
                    self.stop_kind = SIGNAL
                    control = control.merge(Control(should_stop=True, should_save=True))
                if self.process_count > 1:  # every process must take the same (collective) path
                    control = Control(*self.backend.any_process(
                        [control.should_stop, control.should_save, control.should_evaluate]))
                    if control.should_stop and not self.view.stop_reason:
                        self.view.stop_reason = "another process asked to stop (a signal or a callback)"
                if control.should_evaluate or control.should_save or control.should_stop:
                    control = control.merge(self.finish_all(in_flight))
                if control.should_evaluate:
                    control = control.merge(self.evaluate(state))
                if control.should_save:
                    self.save(state, step, position)
                if control.should_stop:
                    stop_reason = self.view.stop_reason or "stopped by a callback"
                    if self.stop_kind == FINISHED:
                        self.stop_kind = EARLY_STOPPED
                    break
            self.finish_all(in_flight)
        if stop_reason == "finished" and self.last_eval_step != step:
            self.evaluate(state)
        self.save(state, step, position)
        self.checkpointer.close()  # waits for the last save and surfaces its failure
        if stop_reason == "finished":
            self.callbacks.fire("on_epoch_end", self.view)
        if stop_reason == "finished" and step < self.max_steps:  # only a stream ends before max_steps
            stop_reason = (f"the training data stream ended after {position} samples, before "
                           f"train.max_steps={self.max_steps}")
        self.callbacks.fire("on_train_end", self.view)
        result = self.result(state, step, position, stop_reason,
                             self.backend.nonfinite_steps_of(state) - nonfinite_at_start)
        if self.is_primary:
            log.info("stopped at step %d (%s)", step, stop_reason)
            report = skipped_report(result)
            if report:
                log.warning("functrain: warning: %s", report)
        return result

    def has_eval_data(self) -> bool:
        return self.eval_data is not None

def fit(config: Config | dict | str | os.PathLike, *, model: Any = None, loss_fn: Callable | None = None,
        optimizer: Any = None, train_data: Any = None, eval_data: Any = None,
        callbacks: list[Callback] | None = None, **overrides: Any) -> FitResult:
    """Train as ``config`` says, with any objects given in place of the config's, resuming from the run
    directory when a checkpoint is there.

    ``config`` is a :class:`~functrain.run.config.Config`, a dict or a YAML path; ``overrides`` are dotted keys
    (``fit("configs/mlp_digits.yaml", **{"train.max_steps": 100})`` or ``train__max_steps=100``).

    Args:
      model: a Flax linen module, an NNX module, ``FunctionalModel(init, apply)`` (or with ``backend: torch``
        an ``nn.Module``) in place of ``model.name`` / ``model.target``.
      loss_fn: ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)`` (sums, see
        :mod:`functrain.core.step`) in place of the built-in loss for the data's fields.
      optimizer: an ``optax.GradientTransformation``, or a function of the config's schedule returning one.
      train_data, eval_data: a dict of arrays or memmaps, an HF ``datasets.Dataset``, a torch ``Dataset``,
        a Grain data source or ``MapDataset``, or a :class:`~functrain.data.Source`.
      callbacks: extra :class:`~functrain.run.callbacks.Callback` objects.

    The resolved config in the run directory records a passed model, data or optimizer as ``python_object``.
    """
    recorded = dict(overrides)
    if model is not None:
        recorded["model"] = {PYTHON_OBJECT: describe_object(model)}
    if train_data is not None:
        recorded["data.name"] = PYTHON_OBJECT
    if optimizer is not None:
        recorded["optimizer.name"] = PYTHON_OBJECT
    config = resolve_config(config, recorded)
    parts = build_parts(config, model=model, loss_fn=loss_fn, optimizer=optimizer, train_data=train_data,
                        eval_data=eval_data)
    run = _Run(config, parts, list(callbacks or []))
    with run.owning_run_dir():
        return run.run()
