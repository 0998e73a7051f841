"""A real 2-process run (``functrain train --processes 2``, gloo collectives) against one process.

Two processes with one CPU device each must compute exactly what one process with two devices computes
(same mesh, same data order; a sum of two partial sums is the same in either order), so the parameter
digests are equal bit for bit. Only process 0 writes metrics. A 2-process job killed after a local save and
restarted by the supervisor (``--restarts``), one process's local copy gone, ends with the same digest too.
"""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, cli_env
from functrain.checkpoint import load_params, params_digest
from functrain.commands import cli

OVERRIDES = ["train.max_steps=4", "train.epochs=null", "train.steps_per_call=2", "log.every_steps=2",
             "log.tensorboard=false", "log.progress=false", "eval.every_steps=0", "checkpoint.every_steps=0", "data.eval_fraction=0"]


def _cli(args: list[str], devices: int = 1) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "functrain", *args], cwd=REPO_ROOT, env=cli_env(devices), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiprocess")
    two_processes, one_process = root / "two_processes", root / "one_process"
    procs = [
        _cli(["train", "configs/mlp_digits.yaml", f"run.dir={two_processes}", *OVERRIDES, "--processes", "2"]),
        _cli(["train", "configs/mlp_digits.yaml", f"run.dir={one_process}", *OVERRIDES], devices=2),
    ]
    outputs = []
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
        outputs.append(output)
    return {"two_processes": two_processes, "one_process": one_process, "output": outputs[0]}


def test_two_processes_end_with_the_same_params_as_one(runs):
    two, one = load_params(runs["two_processes"]), load_params(runs["one_process"])
    assert params_digest(two) == params_digest(one)
    assert np.any(two["dense_0"]["kernel"] != 0)


def _metric_rows(run_dir) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["split"], row.get("loss")) for row in rows]


def test_only_process_zero_writes_metrics(runs):
    rows = _metric_rows(runs["two_processes"])
    assert rows == _metric_rows(runs["one_process"])  # each row once, and the same losses
    assert [step for step, split, _ in rows if split == "train"] == [2, 4]
    assert runs["output"].count("finished at step 4") == 1  # process 1's output is not streamed


def test_port_in_use_is_one_line_and_exit_2(tmp_path, capsys):
    # The launcher checks the port before it starts any process: the command runs here, not in an interpreter of
    # its own (`python -m functrain` exits with what main returns).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        returncode = cli.main(["train", "configs/mlp_digits.yaml", f"run.dir={tmp_path}", "--processes", "2",
                               "--port", str(port)])
    output = "".join(capsys.readouterr())
    assert returncode == 2
    assert f"port {port}" in output and "Traceback" not in output
    assert not (tmp_path / "checkpoints").exists()


def test_sigterm_to_the_launcher_saves_on_every_process_and_exits_for_a_rerun(tmp_path):
    """A preemption notice reaches all processes; they agree on the step, save together and exit with the
    'stopped by a signal, rerun to resume' status (75)."""
    import signal
    import time
    run_dir = tmp_path / "run"
    long_run = [o for o in OVERRIDES if not o.startswith("train.max_steps")] + ["train.max_steps=100000"]
    proc = _cli(["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *long_run, "--processes", "2"])
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)  # the processes train on until the signal: a shorter wait, fewer steps burnt
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 75, output
    assert "SIGTERM received" in output or "another process asked to stop" in output
    steps = [int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert len(steps) == 1 and 0 < steps[0] < 100000
    assert params_digest(load_params(run_dir)) is not None


# Loaded by every interpreter of the job (PYTHONPATH): in the first attempt of a training process, the first
# local save waits for its write, deletes this process's local directory when FT_LOSE names it, and SIGKILLs it.
KILL_AFTER_LOCAL_SAVE = """
import os, sys
marker = os.environ.get("FT_MARKER", "")
if marker and "--restarts" not in sys.argv and "--processes" not in sys.argv and not os.path.exists(marker):
    import shutil, signal
    from functrain.checkpoint import local
    real_save = local.LocalCheckpoints.save
    def save(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        self.wait()
        if self.directory.name == os.environ["FT_LOSE"]:
            shutil.rmtree(self.directory)
        open(marker, "a").close()
        os.kill(os.getpid(), signal.SIGKILL)
    local.LocalCheckpoints.save = save
"""


def test_a_killed_job_restarts_from_local_copies_and_a_peer_bitwise(runs, tmp_path):
    """Killed after its local save of step 2 (no persistent step yet), process 1's local directory deleted (a
    replaced VM): the supervisor restarts both processes; process 0 restores its own copy, process 1 receives its
    shards from process 0 (a data-parallel replica), the train step is a compilation cache hit, and the run ends
    bitwise equal to the uninterrupted ones."""
    from functrain.checkpoint.local import run_key
    from functrain.report.goodput import goodput_report

    hook, run_dir, local_dir = tmp_path / "hook", tmp_path / "run", tmp_path / "local"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_AFTER_LOCAL_SAVE)
    env = cli_env(FT_MARKER=str(tmp_path / "killed"), FT_LOSE="process_1")
    env["PYTHONPATH"] = f"{hook}:{env['PYTHONPATH']}"
    proc = subprocess.run(
        [sys.executable, "-m", "functrain", "train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *OVERRIDES,
         f"checkpoint.local_dir={local_dir}", "checkpoint.local_every_steps=2", "--processes", "2",
         "--restarts", "1", "--restart-delay", "0"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert (tmp_path / "killed").exists() and "the run ended with SIGKILL; restarting in 0s (restart 1 of 1)" in output
    assert "resumed from local checkpoint 2 (epoch 0, samples consumed 128; peer: process 1 from process 0)" in output
    assert "train step: compilation cache hit" in output  # the restart loaded its step, it did not compile it
    assert params_digest(load_params(run_dir)) == params_digest(load_params(runs["one_process"]))
    assert _metric_rows(run_dir) == _metric_rows(runs["one_process"])  # the killed attempt's lines too
    report = goodput_report(run_dir)
    assert "session 2, restarted after SIGKILL: resumed from step 2 (peer: process 1 from process 0)" in report
    for process in (0, 1):  # each holds the newest step again, and only it (checkpoint.local_keep: 1)
        assert [p.name for p in (local_dir / run_key(run_dir) / f"process_{process}").iterdir()] == ["4"]
