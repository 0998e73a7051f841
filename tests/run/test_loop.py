"""The loop: callback events and controls, early stopping, SIGTERM, non-finite stop, resume."""

import json
import logging
import os
import signal
import sys

import jax
import numpy as np
import pytest

from functrain import fit
from functrain.callbacks.base import Callback, CallbackList, Control
from functrain.callbacks.outcome import StopKind
from functrain.callbacks.view import RunRecord, RunView
from functrain.checkpoint import load_params
from functrain.errors import ConfigError
from tests.conftest import run_python

BASE = {"config": "configs/mlp_digits.yaml", "model.hidden": [16], "log.progress": False,
        "log.tensorboard": False, "train.steps_per_call": 4, "log.every_steps": 4, "eval.every_steps": 8,
        "checkpoint.every_steps": 0, "optimizer.warmup_steps": 0}


def run(tmp_path, callbacks=(), **overrides):
    settings = {**BASE, "run.dir": str(tmp_path / "run"), **overrides}
    config = settings.pop("config")
    return fit(config, callbacks=list(callbacks), **settings)


class Recorder(Callback):
    def __init__(self, stop_at=None):
        self.events, self.stop_at = [], stop_at

    def on_train_begin(self, view):
        self.events.append(("train_begin", view.step))

    def on_epoch_begin(self, view):
        self.events.append(("epoch_begin", view.epoch))

    def on_epoch_end(self, view):
        self.events.append(("epoch_end", view.epoch))

    def on_step_end(self, view):
        self.events.append(("step_end", view.step))
        if view.step == self.stop_at:
            return Control(should_stop=True, should_save=True)

    def on_log(self, view, split, step, metrics):
        self.events.append(("log", split, step))

    def on_evaluate(self, view, metrics):
        self.events.append(("evaluate", view.step))

    def on_save(self, view, step):
        self.events.append(("save", step))

    def on_train_end(self, view):
        self.events.append(("train_end", view.step))


def test_events_fire_at_call_boundaries_in_order(tmp_path):
    recorder = Recorder()
    result = run(tmp_path, [recorder], **{"train.max_steps": 32, "data.global_batch_size": 256})
    events = recorder.events
    assert events[0] == ("train_begin", 0) and events[-1] == ("train_end", 32)
    assert [e[1] for e in events if e[0] == "step_end"] == list(range(4, 33, 4))
    assert [e[2] for e in events if e[0] == "log" and e[1] == "train"] == list(range(4, 33, 4))
    assert [e[1] for e in events if e[0] == "evaluate"] == [8, 16, 24, 32]
    assert ("save", 32) in events
    # 1617 records / 256 = 6 steps per epoch (tail dropped): epochs end along the way.
    assert sum(1 for e in events if e[0] == "epoch_end") >= 4
    assert result.step == 32 and result.stop_reason == "finished" and result.stop_kind is StopKind.FINISHED


def test_a_callback_can_stop_and_save(tmp_path):
    result = run(tmp_path, [Recorder(stop_at=12)], **{"train.max_steps": 40})
    assert result.step == 12 and "callback" in result.stop_reason and result.stop_kind is StopKind.CALLBACK
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [12]


def test_early_stopping_on_a_metric_that_does_not_improve(tmp_path):
    result = run(tmp_path, **{"train.max_steps": 200, "optimizer.learning_rate": 1e-12,
                              "eval.early_stopping_metric": "eval/loss", "eval.early_stopping_patience": 2,
                              "eval.early_stopping_min_delta": 0.01})
    assert result.step == 24  # first eval sets the best, two more without improvement
    assert "early stopping" in result.stop_reason and result.stop_kind is StopKind.EARLY_STOPPED
    assert result.exit_code == 0


class Asks(Callback):
    """Sends its requests back in Controls: its own metrics at each evaluation, a stop with a reason."""

    def __init__(self, stop_at):
        self.stop_at, self.seen_at_end = stop_at, None

    def on_evaluate(self, view, metrics):
        return Control(metrics={"probe": {"step_seen": float(view.step), "has_state": float(view.state is not None)}})

    def on_step_end(self, view):
        if view.step == self.stop_at:
            return Control(should_stop=True, stop_reason="the probe is satisfied")

    def on_train_end(self, view):
        self.seen_at_end = (view.stop_kind, view.stop_reason)


def test_a_callback_stop_carries_its_reason_and_its_metrics_are_logged(tmp_path):
    asks = Asks(stop_at=16)
    result = run(tmp_path, [asks], **{"train.max_steps": 40})
    assert result.step == 16 and result.stop_reason == "the probe is satisfied"
    assert result.stop_kind is StopKind.CALLBACK and result.exit_code == 0
    assert asks.seen_at_end == (StopKind.CALLBACK, "the probe is satisfied")
    probe = [line for line in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open()) if line["split"] == "probe"]
    assert [(line["step"], line["step_seen"], line["has_state"]) for line in probe] == [(8, 8.0, 1.0), (16, 16.0, 1.0)]
    assert result.metrics["probe"] == {"step_seen": 16.0, "has_state": 1.0}


class WritesTheView(Callback):
    def on_step_end(self, view):
        if view.step == 8:
            view.stop_reason = "mine"


def test_a_callback_that_writes_to_the_view_gets_a_clear_error(tmp_path):
    with pytest.raises(AttributeError, match="read-only.*view.stop_reason.*Control"):
        run(tmp_path, [WritesTheView()], **{"train.max_steps": 16})


def test_the_view_reads_the_record_and_changes_none_of_it():
    record = RunRecord(config=None, run_dir=None, max_steps=10, is_primary=True)
    view = RunView(record)
    record.step, record.last_metrics["train"] = 4, {"loss": 1.0}
    assert view.step == 4 and view.last_metrics["train"]["loss"] == 1.0
    for write in (lambda: setattr(view, "step", 5), lambda: delattr(view, "state")):
        with pytest.raises(AttributeError, match="read-only"):
            write()
    with pytest.raises(TypeError):
        view.last_metrics["eval"] = {}
    with pytest.raises(TypeError):
        view.last_metrics["train"]["loss"] = 0.0
    assert record.step == 4 and record.last_metrics == {"train": {"loss": 1.0}}


def test_a_stop_with_an_exit_status_outranks_a_callback_stop_and_the_first_stop_stands():
    callback = Control(should_stop=True, stop_reason="mine")
    signal_stop = Control(should_stop=True, should_save=True, stop_kind=StopKind.SIGNAL, stop_reason="SIGTERM")
    for merged in (callback.merge(signal_stop), signal_stop.merge(callback)):
        assert (merged.stop_kind, merged.stop_reason, merged.should_save) == (StopKind.SIGNAL, "SIGTERM", True)
    first = Control(should_stop=True, stop_kind=StopKind.NONFINITE, stop_reason="at step 3")
    later = Control(should_stop=True, stop_kind=StopKind.NONFINITE, stop_reason="at step 5")
    assert first.merge(later).stop_reason == "at step 3"
    assert Control(should_evaluate=True).merge(callback).stop_reason == "mine"
    both = Control(metrics={"a": {"x": 1.0}}).merge(Control(metrics={"a": {"y": 2.0}, "b": {"z": 3.0}}))
    assert both.metrics == {"a": {"x": 1.0, "y": 2.0}, "b": {"z": 3.0}}


class MetricsOutsideEvaluate(Callback):
    def on_step_end(self, view):
        return Control(metrics={"probe": {"x": 1.0}})


def test_metrics_in_a_control_outside_on_evaluate_are_refused():
    view = RunView(RunRecord(config=None, run_dir=None, max_steps=10, is_primary=True))
    with pytest.raises(ConfigError, match="MetricsOutsideEvaluate.on_step_end.*on_evaluate"):
        CallbackList([MetricsOutsideEvaluate()]).fire("on_step_end", view)


class SendSignal(Callback):
    def __init__(self, at_step, signum):
        self.at_step, self.signum = at_step, signum

    def on_step_end(self, view):
        if view.step == self.at_step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_saves_at_the_next_call_boundary_and_stops(tmp_path, signum):
    result = run(tmp_path, [SendSignal(8, signum)], **{"train.max_steps": 40})
    assert result.step == 8 and signal.Signals(signum).name in result.stop_reason
    assert result.stop_kind is StopKind.SIGNAL and result.exit_code == 75
    steps = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [8]
    # The handler is gone afterwards.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL or callable(signal.getsignal(signal.SIGTERM))


def test_nonfinite_stop_keeps_params_finite(tmp_path):
    result = run(tmp_path, **{"train.max_steps": 40, "optimizer.learning_rate": 1e25, "train.nonfinite": "stop",
                              "train.clip_norm": None})
    assert "non-finite" in result.stop_reason and result.step < 40
    assert result.stop_kind is StopKind.NONFINITE and result.exit_code == 3
    params = load_params(tmp_path / "run")
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))


def test_nonfinite_stop_sees_an_incident_in_a_call_it_never_read(tmp_path):
    """One poisoned record at a step that is not logged: the run stops within the calls in flight, names
    that exact step, exits with the non-finite status and keeps params finite."""
    features = np.random.default_rng(0).random((640, 64), np.float32)
    features[5 * 32 + 3] = np.finfo(np.float32).max  # finite, overflows in the 6th batch of 32 (unshuffled): step 6
    np.savez(tmp_path / "poisoned.npz", x=features, y=np.zeros(640, np.int32))
    result = run(tmp_path, **{"data.name": "array_file", "data.path": str(tmp_path / "poisoned.npz"),
                              "data.shuffle": False, "data.global_batch_size": 32, "data.eval_fraction": 0.0,
                              "train.max_steps": 40, "train.steps_per_call": 1, "log.every_steps": 8,
                              "eval.every_steps": 0, "train.nonfinite": "stop"})
    assert "non-finite" in result.stop_reason and "at step 6 " in result.stop_reason
    assert 6 <= result.step <= 8 and result.exit_code == 3 and result.skipped_steps == 1
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(load_params(tmp_path / "run")))
    skipped = [line["skipped_steps"] for line in map(json.loads, (tmp_path / "run" / "metrics.jsonl").open())
               if line["split"] == "train"]
    assert skipped[0] == 1  # exactly the poisoned step was skipped


def test_a_second_run_resumes_where_the_first_stopped(tmp_path):
    first = run(tmp_path, **{"train.max_steps": 16})
    second = run(tmp_path, **{"train.max_steps": 32})
    assert first.step == 16 and second.step == 32
    again = run(tmp_path, **{"train.max_steps": 32})
    assert again.stop_kind is StopKind.ALREADY_FINISHED and "already finished" in again.stop_reason
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [line["step"] for line in lines if line["split"] == "train"]
    assert train_steps == list(range(4, 33, 4))  # no step trained twice, none missing
    assert lines[-1]["samples_consumed"] > 16 * 64


def _train_lines(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["split"] == "train"]


def test_ignore_skip_restarts_the_data_but_keeps_the_model(tmp_path):
    run(tmp_path, **{"train.max_steps": 16})
    run(tmp_path, **{"train.max_steps": 24, "data.ignore_skip": True})
    resumed = [line for line in _train_lines(tmp_path / "run") if line["step"] > 16]
    assert [line["step"] for line in resumed] == [20, 24]
    assert resumed[0]["samples_consumed"] == 4 * 64  # four batches from position 0, not from 16 * 64


def test_skip_samples_sets_the_position(tmp_path):
    run(tmp_path, **{"train.max_steps": 8})
    run(tmp_path, **{"train.max_steps": 12, "data.skip_samples": 1000})
    assert _train_lines(tmp_path / "run")[-1]["samples_consumed"] == 1000 + 4 * 64


def test_resuming_onto_a_different_dataset_is_a_clear_error_and_keeps_the_checkpoint(tmp_path):
    from functrain.errors import DataError
    run(tmp_path, **{"train.max_steps": 8})
    before = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    with pytest.raises(DataError, match="ignore_skip"):
        run(tmp_path, **{"train.max_steps": 16, "data.eval_fraction": 0.2})
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == before


def test_calls_realign_to_multiples_of_steps_per_call_after_an_unaligned_resume(tmp_path):
    run(tmp_path, **{"train.max_steps": 6, "train.steps_per_call": 2, "log.every_steps": 2, "eval.every_steps": 2})
    recorder = Recorder()
    run(tmp_path, [recorder], **{"train.max_steps": 24})  # steps_per_call 4 from step 6
    assert [e[1] for e in recorder.events if e[0] == "step_end"] == [8, 12, 16, 20, 24]
    assert [e[2] for e in recorder.events if e[0] == "log" and e[1] == "train"] == [8, 12, 16, 20, 24]


def test_resume_from_a_step_acts_once(tmp_path):
    run(tmp_path, **{"train.max_steps": 16, "checkpoint.every_steps": 8})
    pinned = {"train.max_steps": 24, "checkpoint.every_steps": 8, "checkpoint.resume": 8}
    first = run(tmp_path, **pinned)  # restarts from step 8, as asked
    again = run(tmp_path, **{**pinned, "train.max_steps": 32})  # the same command again: continues from 24
    assert first.step == 24 and again.step == 32
    assert [line["step"] for line in _train_lines(tmp_path / "run")] == list(range(4, 33, 4))
    aside = (tmp_path / "run" / "metrics.abandoned.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside if json.loads(line)["split"] == "train"] == [12, 16]


def test_metrics_after_the_resumed_checkpoint_are_set_aside_not_duplicated(tmp_path):
    run(tmp_path, **{"train.max_steps": 16, "checkpoint.every_steps": 8})
    # As if the run had crashed after step 16 was logged but before its checkpoint: resume from step 8.
    run(tmp_path, **{"train.max_steps": 16, "checkpoint.every_steps": 8, "checkpoint.resume": 8})
    steps = [line["step"] for line in _train_lines(tmp_path / "run")]
    assert steps == [4, 8, 12, 16]
    aside = (tmp_path / "run" / "metrics.abandoned.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside if json.loads(line)["split"] == "train"] == [12, 16]


def test_fit_says_what_the_command_line_says_and_its_result_prints_as_one_line(tmp_path):
    """A plain script (logging left as Python and absl leave it): fit prints the run directory line and the
    summary on stderr, once each, and its result as one line."""
    proc = run_python(f"""
        import functrain
        result = functrain.fit("configs/mlp_digits.yaml", **{{"run.dir": "{tmp_path / 'run'}", "train.max_steps": 8,
                               "model.hidden": [16], "log.progress": False}})
        print(result)
    """)
    run_dir = tmp_path / "run"
    assert proc.stderr.count(f"run {run_dir}: steps 0 -> 8") == 1 and proc.stderr.count(f"summary of {run_dir}:") == 1
    printed = proc.stdout.strip().splitlines()
    assert len(printed) == 1 and len(printed[0]) < 300 and "TrainState" not in printed[0]
    assert printed[0].startswith(f"FitResult(finished at step 8, 8 steps run, run_dir='{run_dir}'")
    assert "train loss" in printed[0] and "eval accuracy" in printed[0]


def test_fit_leaves_logging_a_program_configured_to_it(monkeypatch):
    from functrain.report import console

    run_log = logging.getLogger(console.RUN_LOGGER)
    monkeypatch.setattr(run_log, "handlers", [])
    monkeypatch.setattr(run_log, "level", logging.NOTSET)
    monkeypatch.setattr(run_log, "propagate", True)
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.FileHandler(os.devnull)])  # the program's own
    console.show_run_lines()
    assert run_log.handlers == [] and run_log.propagate  # its records still reach the program's handlers
    monkeypatch.setattr(logging.getLogger(), "handlers", [logging.StreamHandler(sys.stderr)])  # absl's bare default
    console.show_run_lines()
    assert [type(h) for h in run_log.handlers] == [console.StderrHandler] and not run_log.propagate
