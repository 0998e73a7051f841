"""Kill `functrain train` at awkward moments, resume, and get bit-identical parameters and losses.

Each interrupted attempt runs the real CLI (``functrain.commands.cli.main``) in a subprocess. A few lines of
instrumentation pick the moment precisely: SIGKILL right after a save() returned (its background write
in flight), SIGKILL right after a multi-step call was dispatched (the device is inside the call), and
SIGTERM mid-epoch (the loop must save and exit 75, "rerun to resume"). One more attempt is killed from outside at whatever
point it has reached. The final parameters (what ``functrain inspect --digest`` prints) and every logged
training loss must equal those of one uninterrupted run.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, cli_env
from functrain.commands.inspect import inspect_report
from functrain.report.events import read_events
from functrain.report.goodput import goodput_of

OVERRIDES = ["train.max_steps=60", "train.steps_per_call=5", "checkpoint.every_steps=10", "checkpoint.keep=2",
             "log.every_steps=5", "eval.every_steps=20", "log.progress=false"]

# FT_KILL="save:N" / "call:N" / "term:N" sends SIGKILL after the N-th save() returns / SIGKILL or SIGTERM to
# itself right after the N-th train call is dispatched (while it runs). Other tests put their run after it.
KILL_HOOKS = """
import os, signal, sys
from functrain.run import jax_backend as backend_module
from functrain.checkpoint import Checkpointer
kind, _, count = os.environ.get("FT_KILL", "none:0").partition(":")
count = int(count or 0)
seen = {"save": 0, "call": 0}
real_save = Checkpointer.save
def save(self, *args, **kwargs):
    started = real_save(self, *args, **kwargs)
    seen["save"] += 1
    if kind == "save" and seen["save"] == count:
        os.kill(os.getpid(), signal.SIGKILL)
    return started
Checkpointer.save = save
real_call = backend_module.JaxBackend.train_call
def train_call(self, state, batches):
    result = real_call(self, state, batches)
    seen["call"] += 1
    if kind in ("call", "term") and seen["call"] == count:
        os.kill(os.getpid(), signal.SIGKILL if kind == "call" else signal.SIGTERM)
    return result
backend_module.JaxBackend.train_call = train_call
"""
# Runs the real CLI under the hooks.
DRIVER = KILL_HOOKS + """
from functrain.commands import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def _env(kill: str = "none:0") -> dict:
    return cli_env(FT_KILL=kill)


def _train(run_dir: Path, kill: str = "none:0") -> subprocess.CompletedProcess:
    args = ["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *OVERRIDES]
    return subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=REPO_ROOT, env=_env(kill),
                          capture_output=True, text=True, timeout=300)


def _digest_line(report: str) -> str:
    lines = [line for line in report.splitlines() if line.startswith("sha256 step")]
    assert len(lines) == 1, report
    return lines[0]


def _cli_digest(run_dir: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "functrain", "inspect", str(run_dir), "--digest"], cwd=REPO_ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return _digest_line(proc.stdout)


def _digest(run_dir: Path) -> str:
    """What `functrain inspect RUN_DIR --digest` prints, computed in this process (no second jax start-up)."""
    return _digest_line(inspect_report(run_dir, digest=True))


def _kill_when_logged(run_dir: Path, step: int) -> None:
    """Start an attempt and SIGKILL it from outside once it has logged ``step``."""
    args = ["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *OVERRIDES]
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], cwd=REPO_ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            break
        time.sleep(0.002)
    proc.kill()
    proc.wait()


def _train_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(row["step"], row["loss"]) for row in rows if row.get("split") == "train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    proc = _train(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = dict(_train_losses(run_dir))
    assert sorted(losses) == list(range(5, 61, 5))
    digest = _cli_digest(run_dir)
    assert digest.startswith("sha256 step 60: ") and digest == _digest(run_dir)
    return digest, losses


def _assert_matches(run_dir: Path, reference) -> None:
    digest, losses = reference
    assert _digest(run_dir) == digest
    logged = _train_losses(run_dir)
    assert {step for step, _ in logged} == set(losses)
    for step, loss in logged:  # every attempt's log lines, including those logged before a kill
        assert loss == losses[step], f"step {step}: {loss} != {losses[step]}"


def test_sigkill_during_async_save_inside_a_call_and_from_outside(tmp_path, reference):
    # 1st attempt: killed right after save() of step 20 returned (step 10 committed, 20 in flight).
    assert _train(tmp_path, "save:2").returncode == -signal.SIGKILL
    # 2nd attempt resumes, then dies right after dispatching its 3rd call (inside steps 31-35 or later).
    assert _train(tmp_path, "call:3").returncode == -signal.SIGKILL
    # 3rd attempt is killed from outside at whatever point it has reached after logging step 45.
    _kill_when_logged(tmp_path, 45)
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_matches(tmp_path, reference)
    # Goodput: the steps an attempt logged past the checkpoint the next one resumed from (the lines each resume set
    # aside, one per 5 steps) are computed again, those after the attempt's last event too (attempt 1's steps 11-20).
    aside = [json.loads(line) for line in (tmp_path / "metrics.abandoned.jsonl").read_text().splitlines()]
    redone = 5 * sum(row["split"] == "train" for row in aside)
    goodput = goodput_of(read_events(tmp_path))
    assert len(goodput.sessions) == 4 and redone > 0 and goodput.retrained_steps == redone
    assert f"retrained {redone} steps, " in proc.stderr  # the run's summary


def test_sigterm_mid_epoch_saves_and_resumes(tmp_path, reference):
    proc = _train(tmp_path, "term:7")  # SIGTERM while the call for steps 31-35 runs (epoch 1 of 25-step epochs)
    assert proc.returncode == 75, proc.stderr[-3000:]  # saved and stopped: rerun to resume
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] % 10 != 0 and 30 <= steps[-1] <= 40  # saved at the stop, not at a scheduled step
    proc = _train(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_matches(tmp_path, reference)
