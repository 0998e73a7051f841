"""examples/torch_transformers_gpt2.py: a transformers GPT-2 through ``backend: torch`` learns, and a run
SIGKILLed after its first checkpoint resumes to the same parameters (dropout included) as an uninterrupted one."""

import importlib.util
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

import functrain
from tests.conftest import REPO_ROOT, cli_env
from functrain.checkpoint.layout import checkpoints_dir, committed_steps
from functrain.commands.inspect import inspect_report
from torch_bridge.user_model import build_module

STEPS, EVERY = 20, 5


def _example(run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "examples/torch_transformers_gpt2.py", "--run-dir", str(run_dir),
                             "--steps", str(STEPS), "--every", str(EVERY)], cwd=REPO_ROOT,
                            env=cli_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _uninterrupted(run_dir: Path) -> None:
    """The example's run in this process (no second start-up), on one thread as the subprocesses are."""
    spec = importlib.util.spec_from_file_location("torch_transformers_gpt2",
                                                  REPO_ROOT / "examples" / "torch_transformers_gpt2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        functrain.fit(example.config(str(run_dir), STEPS, EVERY), model=build_module(example.build_gpt2, seed=0))
    finally:
        torch.set_num_threads(threads)


def _digest(run_dir: Path) -> str:
    return next(line for line in inspect_report(run_dir, digest=True).splitlines() if line.startswith("sha256 step"))


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = ("step", "loss", "grad_norm", "accuracy", "learning_rate", "samples_consumed")  # not the timings
    return [{key: row[key] for key in kept} for row in rows if row["split"] == "train"]


def test_gpt2_example_learns_and_resumes_bitwise_after_sigkill(tmp_path):
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    killed_run = _example(interrupted)
    deadline = time.monotonic() + 240
    while not committed_steps(checkpoints_dir(interrupted)) and killed_run.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    killed_run.send_signal(signal.SIGKILL)
    output, _ = killed_run.communicate(timeout=60)
    assert killed_run.returncode == -signal.SIGKILL, f"the run ended before it could be killed:\n{output}"
    saved = committed_steps(checkpoints_dir(interrupted))
    assert saved and STEPS not in saved

    resumed = _example(interrupted)
    _uninterrupted(reference)  # while the resumed run starts up
    resumed_out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, resumed_out
    assert f"step {STEPS}: train loss" in resumed_out

    rows = _train_rows(reference)
    assert rows[-1]["loss"] < 0.8 * math.log(256) and rows[-1]["loss"] < rows[0]["loss"]  # it learns
    assert _digest(reference) == _digest(interrupted)
    assert rows[-1] == _train_rows(interrupted)[-1]
