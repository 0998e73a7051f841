"""profile.start_step / profile.steps: a JAX profiler trace of a window of steps under RUN_DIR/profile/."""

import subprocess
import sys

from functrain import fit
from tests.conftest import REPO_ROOT, cli_env

TINY = {"train.max_steps": 6, "train.steps_per_call": 1, "log.every_steps": 2, "eval.every_steps": 0,
        "eval.samples.count": 0, "checkpoint.every_steps": 0, "model.d_model": 32, "model.d_ff": 64,
        "model.n_layers": 1, "data.seq_len": 16, "data.global_batch_size": 4, "log.progress": False,
        "log.plot": False}


def test_a_profile_window_writes_a_trace_under_the_run_directory(tmp_path):
    fit("configs/char_gpt.yaml", **TINY, **{"run.dir": str(tmp_path / "r"), "profile.start_step": 2,
                                            "profile.steps": 2})
    traces = list((tmp_path / "r" / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_a_profile_window_past_the_end_of_the_run_is_one_line_exit_2(tmp_path):
    overrides = [f"{key}={value}" for key, value in TINY.items()]
    proc = subprocess.run([sys.executable, "-m", "functrain", "train", "configs/char_gpt.yaml", *overrides,
                           f"run.dir={tmp_path / 'r'}", "profile.start_step=6", "profile.steps=2"],
                          capture_output=True, text=True, env=cli_env(), cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "functrain: error: profile.start_step=6 is past the end of the run (6 steps); set profile.start_step below 6"]
    assert not (tmp_path / "r").exists()
