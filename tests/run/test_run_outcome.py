"""Nothing silent, nothing shared by accident (the loop side): bad data and settings against a run directory
with checkpoints get one line, exit 2 and leave it byte-identical; a rerun of a finished run changes
nothing; runs that barely trained or stopped say so in their exit status; one job per run directory."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from tests.conftest import REPO_ROOT, cli_env
from functrain.commands.cli import main
from functrain.errors import ConfigError, DataError
from functrain.guards.lock import LOCK_NAME, RunLock
from tests.commands.test_cli import TINY, snapshot


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    # Trained in this process too (the CLI's entry point): the real-process runs are the signal tests below.
    run_dir = tmp_path_factory.mktemp("outcome") / "run"
    assert main(["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *TINY]) == 0
    return run_dir


def _digits_like(path: Path, **fields: np.ndarray) -> str:
    np.savez(path, **fields)
    return f"data.path={path}"


def _data_case(name: str, tmp: Path) -> tuple[list[str], str]:
    """Overrides pointing the finished digits run at bad data, and the text its one line must hold."""
    x = np.zeros((200, 64), np.float32)
    y = np.zeros(200, np.int32)
    npz = tmp / f"{name}.npz"
    if name == "empty_npz":
        npz.write_bytes(b"")
        return ["data.name=array_file", f"data.path={npz}"], "is empty"
    if name == "missing_field":
        return (["data.name=array_file", _digits_like(npz, x=x)],
                "no labels for input 'x' among the data's fields ['x']")
    if name == "float_labels":
        return ["data.name=array_file", _digits_like(npz, x=x, y=y.astype(np.float32))], "must be integers"
    if name == "label_beyond_classes":
        y[150] = 10
        return ["data.name=array_file", _digits_like(npz, x=x, y=y)], "record 150 field 'y' holds label 10"
    if name == "nonfinite_input":
        x[150, 3] = np.nan
        return (["data.name=array_file", _digits_like(npz, x=x, y=y)],
                "record 150 field 'x' holds nan, but inputs must be finite numbers")
    if name == "negative_label":
        y[7] = -1
        return ["data.name=array_file", _digits_like(npz, x=x, y=y)], "record 7 field 'y' holds label -1"
    raise AssertionError(name)


SETTINGS = {
    "heads_do_not_divide": (["model={name: gpt, d_model: 30, n_heads: 4}", "data.name=char_text"],
                            "model.n_heads=4 does not divide model.d_model=30"),
    "resume_negative": (["checkpoint.resume=-1"], "must be 'auto', 'never' or a checkpoint step"),
    "backend_changed": (["backend=torch"], "was written by backend jax, this run uses backend torch"),
    "optimizer_changed": (["optimizer.name=sgd"], "holds adamw optimizer state but this run sets optimizer.name=sgd"),
    "early_stop_metric_never_logged": (["eval.early_stopping_metric=eval/acc"],
                                       "'eval/acc' is not a metric this run logs; choose one of eval/accuracy"),
}
DATA = ["empty_npz", "missing_field", "float_labels", "label_beyond_classes", "negative_label", "nonfinite_input"]


@pytest.mark.parametrize("case", sorted(SETTINGS) + DATA)
def test_bad_input_against_a_run_with_checkpoints_is_one_line_and_changes_nothing(case, finished_run, tmp_path,
                                                                                   capsys):
    # In this process (the CLI's own entry point, without an interpreter's start-up a case): the run it is
    # refused against was trained by a real one.
    overrides, expected = SETTINGS[case] if case in SETTINGS else _data_case(case, tmp_path)
    before = snapshot(finished_run)
    status = main(["train", "configs/mlp_digits.yaml", f"run.dir={finished_run}", *TINY, "train.max_steps=80",
                   *overrides])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, err
    assert lines[0].startswith("functrain: error:") and expected in lines[0], lines[0]
    assert snapshot(finished_run) == before


def test_rerunning_a_finished_run_leaves_it_byte_identical(finished_run, capsys):
    before = snapshot(finished_run)
    listing = sorted(p.name for p in finished_run.rglob("*"))
    assert main(["train", "configs/mlp_digits.yaml", f"run.dir={finished_run}", *TINY]) == 0
    assert "already finished" in capsys.readouterr().out
    assert snapshot(finished_run) == before and sorted(p.name for p in finished_run.rglob("*")) == listing


def test_a_run_that_barely_trained_exits_4_and_says_how_many_steps_were_skipped(tmp_path, capsys):
    status = main(["train", "configs/mlp_digits.yaml", f"run.dir={tmp_path / 'r'}", *TINY, "train.max_steps=20",
                   "optimizer.name=sgd", "optimizer.learning_rate=1e6", "train.clip_norm=null"])
    assert status == 4
    err = capsys.readouterr().err
    assert "steps (" in err and "were skipped: the model barely trained" in err


def test_a_non_finite_stop_exits_3_naming_the_first_bad_step(tmp_path, capsys):
    x = np.random.default_rng(0).random((320, 64), np.float32)
    x[9 * 32] = np.finfo(np.float32).max  # finite, but it overflows the forward pass of step 10 (batch 32)
    np.savez(tmp_path / "d.npz", x=x, y=np.zeros(320, np.int32))
    status = main(["train", "configs/mlp_digits.yaml", f"run.dir={tmp_path / 'r'}", *TINY, "train.max_steps=40",
                   "train.nonfinite=stop", "data.name=array_file", f"data.path={tmp_path / 'd.npz'}",
                   "data.shuffle=false", "data.global_batch_size=32", "data.eval_fraction=0"])
    out, err = capsys.readouterr()
    assert status == 3, err
    assert "non-finite loss or gradients at step 10 " in out


def test_a_bad_record_deep_in_the_data_stops_before_its_step_with_nothing_saved_from_it(tmp_path):
    """Record 500 of 640 (unshuffled, batch 32: the 16th batch) holds a label beyond the classes. Read through a
    memory map (no up-front pass over the file), the check in the prefetch thread stops the stream at that
    batch, so no step is ever dispatched with it."""
    y = np.zeros(640, np.int32)
    y[500] = 12
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "x.npy", np.zeros((640, 64), np.float32))
    from functrain.data.validate import BatchCheck, FieldRule
    from functrain.data import BatchLoader, IndexSampler
    memmapped = {"x": np.load(tmp_path / "x.npy", mmap_mode="r"), "y": np.load(tmp_path / "y.npy", mmap_mode="r")}
    check = BatchCheck([FieldRule("x", integer=False), FieldRule("y", upper=10, bound_key="model.num_classes",
                                                                   what="label")])
    loader = BatchLoader(memmapped, IndexSampler(640, 32, seed=0, shuffle=False), check=check, prefetch=2)
    batches = []
    with pytest.raises(DataError) as caught, loader.iter_from(0) as calls:
        for batch, _, _ in calls:
            batches.append(batch)
    assert "record 500 field 'y' holds label 12" in str(caught.value) and "model.num_classes" in str(caught.value)
    assert len(batches) == 15  # every batch before the bad one, none from it


def test_two_jobs_on_one_run_directory_one_runs_the_other_exits_2_naming_it(tmp_path, capsys):
    run_dir = tmp_path / "r"
    first = subprocess.Popen([sys.executable, "-m", "functrain", "train", "configs/mlp_digits.yaml", f"run.dir={run_dir}",
                              *TINY, "train.max_steps=100000", "checkpoint.every_steps=0"],
                             cwd=REPO_ROOT, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.2)
        # The second job in this process (the lock is a file and a pid: no interpreter start-up needed), so the
        # first trains only as long as the refusal takes.
        status = main(["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *TINY])
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert status == 2 and len(lines) == 1, err
        assert f"is in use by another job (pid {first.pid} on host {socket.gethostname()}" in lines[0]
        assert first.poll() is None  # the owner is untouched
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 75  # saved and stopped by the signal
    assert not (run_dir / LOCK_NAME).exists()


def test_the_lock_of_a_killed_job_is_taken_over_with_a_warning(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = psutil.Process(dead.pid).create_time()
    dead.kill()
    dead.wait()
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid,
                                                 "process_start": started, "started": time.time(),
                                                 "heartbeat": time.time()}))
    with RunLock(run_dir) as lock:
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid() and lock.held
    assert "took over the lock" in caplog.text and f"process {dead.pid} is gone" in caplog.text
    assert not (run_dir / LOCK_NAME).exists()


def test_a_lock_from_another_host_is_stale_only_when_its_heartbeat_stops(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    owner = {"host": "another-host", "pid": 1, "started": time.time() - 3600}
    (run_dir / LOCK_NAME).write_text(json.dumps({**owner, "heartbeat": time.time() - 5}))
    with pytest.raises(ConfigError, match="in use by another job .pid 1 on host another-host"):
        RunLock(run_dir).acquire()
    (run_dir / LOCK_NAME).write_text(json.dumps({**owner, "heartbeat": time.time() - 3600}))
    lock = RunLock(run_dir).acquire()
    lock.release()
    assert not (run_dir / LOCK_NAME).exists()


def test_the_heartbeat_keeps_the_lock_fresh(tmp_path):
    lock = RunLock(tmp_path, heartbeat_every_s=0.05).acquire()
    try:
        first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
        time.sleep(0.3)
        assert json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first
    finally:
        lock.release()


SLOW_DATA = '''
import time
import numpy as np
from sklearn.datasets import load_digits


def digits():
    time.sleep(30)  # a slow start (a large restore, a long compile): the window a preemption hits
    data = load_digits()
    return {"x": (data.data / 16).astype(np.float32), "y": data.target.astype(np.int32)}
'''


def test_sigterm_before_the_first_step_exits_75_and_leaves_the_run_as_it_was(finished_run, tmp_path):
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    before = snapshot(finished_run)
    proc = subprocess.Popen([sys.executable, "-m", "functrain", "train", "configs/mlp_digits.yaml",
                             f"run.dir={finished_run}", *TINY, "train.max_steps=100", "data.target=slow_data:digits"],
                            cwd=REPO_ROOT, env=cli_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(4)  # JAX imported, the run directory locked, the data loading
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75, stderr
    assert "SIGTERM received outside the training loop" in stderr
    assert snapshot(finished_run) == before


def test_a_model_too_large_for_the_machine_is_refused_in_seconds_with_nothing_allocated(finished_run, capsys):
    """A trillion parameters (12 TB with Adam's moments): the refusal comes from shapes, before the lock or any
    allocation (an allocation this large would hang rather than fail)."""
    before = snapshot(finished_run)
    started = time.monotonic()
    status = main(["train", "configs/mlp_digits.yaml", f"run.dir={finished_run}", *TINY,
                   "model.hidden=[1000000,1000000]"])
    elapsed = time.monotonic() - started
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2 and len(lines) == 1, lines
    assert "the training state needs" in lines[0] and "of host memory" in lines[0], lines[0]
    assert "mesh.fsdp" in lines[0] and "smaller model" in lines[0] and "functrain plan" in lines[0], lines[0]
    assert elapsed < 30, elapsed
    assert snapshot(finished_run) == before


SLOW_INIT_MODEL = '''
import time
from pathlib import Path

import flax.linen as nn
import jax


def _wait(value):
    Path(__file__).with_name("init_started").touch()
    time.sleep(120)  # the runtime busy for minutes (an allocation that waits for memory): the main thread with it
    return value


def slow_init(key, shape, dtype=None):
    value = jax.random.normal(key, shape)
    return jax.pure_callback(_wait, jax.ShapeDtypeStruct(value.shape, value.dtype), value)


class SlowInit(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10, kernel_init=slow_init)(x)


def slow_mlp(num_classes):
    return SlowInit()
'''


def test_sigint_while_the_state_is_created_in_the_runtime_exits_75_within_seconds(tmp_path):
    """The main thread waits inside the runtime, where Python runs no signal handler: the stop-signal watcher
    ends the process with the same line and status, and the run directory keeps no file (not even the lock)."""
    (tmp_path / "slow_init.py").write_text(SLOW_INIT_MODEL)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "functrain", "train", "configs/mlp_digits.yaml",
                             f"run.dir={run_dir}", *TINY, "model={target: 'slow_init:slow_mlp', num_classes: 10}"],
                            cwd=REPO_ROOT, env=cli_env(PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO_ROOT}"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "init_started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert time.monotonic() - signalled < 15
    assert proc.returncode == 75, stderr
    assert "SIGINT received outside the training loop" in stderr
    assert snapshot(run_dir) == {}
