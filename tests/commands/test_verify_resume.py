"""``functrain verify-resume``: PASS (exit 0) on a shipped config, FAIL (exit 1) with the first differing step
when the data carries unseeded randomness, one line and exit 2 for a bad config. And the command's check at the
cost of one subprocess, for the tests of models and tasks that resume bitwise after a kill."""

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import functrain
from functrain.checkpoint import layout, load_params, params_digest
from functrain.commands.cli import main
from functrain.commands.verify_resume import (
    checked_settings,
    first_difference,
    logged_training,
    random_kill_step,
    save_interval,
)
from functrain.config.load import load_config
from functrain.config.schema import Config
from tests.conftest import REPO_ROOT, cli_env

# A dataset whose records get noise from an unseeded generator: every process sees other data, the kind of
# bug a user's own data code can carry into a week-long run.
NOISY_DATA = textwrap.dedent('''
    import numpy as np
    from functrain.data import datasets

    def noisy_digits(data_config):
        arrays = datasets.LOADERS["digits"](data_config)
        arrays["x"] = arrays["x"] + np.random.default_rng().normal(0, 0.1, arrays["x"].shape).astype("float32")
        return arrays

    datasets.LOADERS["noisy_digits"] = noisy_digits
''')
TINY = ["train.steps_per_call=1", "eval.every_steps=0", "model.hidden=[16]"]


def test_verify_resume_passes_on_a_shipped_config(capsys):
    assert main(["verify-resume", "configs/mlp_digits.yaml", "--steps", "8", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS") and "params sha256 equal" in out


def test_verify_resume_fails_on_unseeded_randomness_in_the_data(tmp_path, monkeypatch, capsys):
    (tmp_path / "noisy_data.py").write_text(NOISY_DATA)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}")
    status = main(["verify-resume", "configs/mlp_digits.yaml", "--steps", "8", "--import", "noisy_data",
                   "data.name=noisy_digits", *TINY])
    out = capsys.readouterr().out
    assert status == 1, out
    assert out.startswith("FAIL") and "first difference: step 1: loss" in out


def test_verify_resume_of_a_bad_config_is_one_line_exit_2(capsys):
    assert main(["verify-resume", "configs/mlp_digits.yaml", "train.max_stepz=3"]) == 2
    assert "unknown config key 'train.max_stepz'" in capsys.readouterr().err


KILLED = """
import json, sys
import functrain
from functrain.commands.verify_resume import KillAt
from functrain.config.load import load_config

path, base, overrides, kill_step = json.loads(sys.argv[1])
functrain.fit(load_config(path, overrides, base), callbacks=[KillAt(kill_step)])
"""


def _path_and_base(config: str | Path | dict) -> tuple[str | None, dict | None]:
    """load_config's arguments for a YAML path or a dict."""
    return (str(config), None) if isinstance(config, (str, Path)) else (None, config)


def _loaded(config: str | Path | dict, overrides: list[str]) -> Config:
    path, base = _path_and_base(config)
    return load_config(path, overrides, base)


def killed_after_a_save(config: str | Path | dict, run_dir: Path, kill_step: int, overrides: Sequence[str] = (),
                        devices: int | None = None) -> Path:
    """``config`` (a YAML path or a dict) with ``overrides`` trained into ``run_dir`` in a process of its own (of
    ``devices`` simulated CPU devices) that SIGKILLs itself at its first call boundary at or after ``kill_step``
    once a checkpoint is committed (verify-resume's kill): what it left on disk, for a fresh run to resume. One
    subprocess; the uninterrupted run and the resumed one can stay in the caller's process."""
    job = [*_path_and_base(config), [*overrides, f"run.dir={run_dir}"], kill_step]
    proc = subprocess.run([sys.executable, "-c", KILLED, json.dumps(job)], cwd=REPO_ROOT, env=cli_env(devices),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return run_dir


def assert_resumes_as_uninterrupted(config: str | Path | dict, work: Path, steps: int, overrides: Sequence[str] = (),
                                    devices: int | None = None) -> None:
    """verify-resume's check with one subprocess in place of three: ``config`` trained ``steps`` steps under the
    command's settings uninterrupted in this process; killed (SIGKILL, in a process of its own) at a random call
    boundary after a committed checkpoint; resumed in this process, where the uninterrupted run's programs are
    compiled already. The resumed run trains only the steps after the newest committed checkpoint, and ends with
    the uninterrupted run's params digest and every logged training metric, step by step."""
    per_call = _loaded(config, list(overrides)).train.steps_per_call
    settings = [*overrides, *checked_settings(steps, per_call)]
    kill_step = random_kill_step(steps, per_call)
    uninterrupted, interrupted = work / "uninterrupted", work / "interrupted"
    functrain.fit(_loaded(config, [*settings, f"run.dir={uninterrupted}"]))
    killed_after_a_save(config, interrupted, kill_step, settings, devices)
    resumed_from = max(layout.committed_steps(layout.checkpoints_dir(interrupted)))
    assert save_interval(steps, per_call) <= resumed_from < steps, (resumed_from, kill_step)
    resumed = functrain.fit(_loaded(config, [*settings, f"run.dir={interrupted}"]))
    assert resumed.steps_run == steps - resumed_from, (resumed.steps_run, resumed_from, kill_step)
    reference = logged_training(uninterrupted)
    assert sorted(reference) == list(range(per_call, steps + 1, per_call))
    assert first_difference(reference, logged_training(interrupted)) is None, f"killed at step {kill_step}"
    assert params_digest(load_params(interrupted)) == params_digest(load_params(uninterrupted))
