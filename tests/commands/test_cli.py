"""The command line end to end: a tiny run, and bad input that gets one line, exit 2 and loses nothing."""

import hashlib
import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from functrain.commands.cli import main
from tests.conftest import REPO_ROOT, cli_env

TINY = ["train.max_steps=40", "train.steps_per_call=4", "log.every_steps=4", "eval.every_steps=20",
        "checkpoint.every_steps=20", "log.progress=false", "model.hidden=[32]",
        "optimizer.warmup_steps=0", "optimizer.learning_rate=0.01"]


def functrain(*args: str, devices: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "functrain", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, env=cli_env(devices), timeout=300)


def snapshot(run_dir: Path) -> dict[str, str]:
    """Hash of every file under the run directory."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = functrain("train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", *TINY)
    assert proc.returncode == 0, proc.stderr
    return run_dir


def test_train_writes_the_run_directory_and_the_loss_falls(trained_run):
    assert (trained_run / "config.yaml").is_file()
    assert any((trained_run / "tensorboard").iterdir())
    lines = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["split"] == "train"]
    assert [line["step"] for line in train] == list(range(4, 41, 4))
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    assert {"epoch", "samples_consumed", "grad_norm", "learning_rate", "accuracy"} <= set(train[0])
    evals = [line for line in lines if line["split"] == "eval"]
    assert [line["step"] for line in evals] == [20, 40]
    steps = sorted(int(p.name) for p in (trained_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [20, 40]


def test_inspect_lists_checkpoints_and_a_stable_digest(trained_run, capsys):
    def inspect(*args: str) -> str:  # in this process: the run above is the real process
        assert main(["inspect", str(trained_run), *args]) == 0
        return capsys.readouterr().out

    report = inspect()
    assert "40" in report and "20" in report
    first, again = inspect("--digest"), inspect("--digest", "--step", "40")
    digests = [line for line in first.split() if len(line) == 64]
    assert digests and digests[0] in again


BAD_INPUTS = {
    "malformed_yaml": (["train", "{bad}"], "not valid YAML"),
    "unknown_key": (["train", "configs/mlp_digits.yaml", "train.max_step=3"], "did you mean 'train.max_steps'"),
    "wrong_type": (["train", "configs/mlp_digits.yaml", "train.max_steps=many"], "train.max_steps"),
    "intervals": (["train", "configs/mlp_digits.yaml", "train.steps_per_call=3"], "multiple of 3"),
    "batch_not_divisible": (["train", "configs/mlp_digits.yaml", "data.global_batch_size=6", "train.micro_batches=4"],
                            "not divisible by train.micro_batches=4"),
    "infinite_learning_rate": (["train", "configs/mlp_digits.yaml", "optimizer.learning_rate=inf"],
                               "'optimizer.learning_rate': Input should be a finite number"),
    "no_processes": (["train", "configs/mlp_digits.yaml", "--processes", "0"], "--processes 0 must be at least 1"),
    "missing_data_file": (["train", "configs/mlp_digits.yaml", "data.name=array_file", "data.path=/nonexistent.npz"],
                          "does not exist"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_the_run_directory_is_untouched(case, trained_run, tmp_path, capfd):
    # In this process (main is the console script's entry; the process's own exit status and stderr are checked
    # by the test below, with 4 devices).
    args, expected = BAD_INPUTS[case]
    if args[1] == "{bad}":
        bad = tmp_path / "bad.yaml"
        bad.write_text("model: {name: mlp\n")
        args = ["train", str(bad)]
    before = snapshot(trained_run)
    assert main([*args, f"run.dir={trained_run}"]) == 2
    stderr = capfd.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("functrain: error:") and expected in lines[0], stderr
    assert "Traceback" not in stderr
    assert snapshot(trained_run) == before


def test_batch_not_divisible_by_micro_batches_times_data_devices(tmp_path):
    proc = functrain("train", "configs/mlp_digits.yaml", f"run.dir={tmp_path / 'r'}", "data.global_batch_size=6",
                     "train.micro_batches=2", "mesh.data=4", devices=4)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("functrain: error:"), proc.stderr
    assert "train.micro_batches=2 x the 4 data-parallel devices" in lines[0] and "multiple of 8" in lines[0]
    assert not (tmp_path / "r").exists()


def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path):
    import numpy as np
    data = tmp_path / "tokens.npz"
    np.savez(data, tokens=np.full((64, 17), 300, np.int32))
    proc = functrain("train", "configs/char_gpt.yaml", f"run.dir={tmp_path / 'r'}", "data.name=array_file",
                     f"data.path={data}", "data.seq_len=16")
    assert proc.returncode == 2 and "token id 300" in proc.stderr and "< 256 (model.vocab_size)" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_logging_is_configured_once_and_writes_to_the_current_stderr(tmp_path, monkeypatch):
    """Two ``main()`` calls in one process print each line once; a line logged after the stream ``main()``
    saw as stderr was closed goes to the new stderr, with no logging error."""
    seen = io.StringIO()
    monkeypatch.setattr(sys, "stderr", seen)
    for _ in range(2):
        assert main(["inspect", str(tmp_path / "no_run")]) == 2
    logging.getLogger("functrain").info("a line")
    assert seen.getvalue().count("a line") == 1
    seen.close()
    now = io.StringIO()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("functrain.checkpoint").info("a line after the close")
    assert now.getvalue() == "a line after the close\n"  # no "--- Logging error ---" either


@pytest.mark.parametrize("words, line", [
    (["train", "configs/mlp_digits.yaml", "--restarts", "abc"],
     "functrain train: error: argument --restarts: invalid int value: 'abc'; see functrain train --help"),
    (["plan", "configs/mlp_digits.yaml", "--slices"],
     "functrain plan: error: argument --slices: expected one argument; see functrain plan --help"),
])
def test_a_bad_flag_is_one_line_naming_it_exit_2(words, line, capsys):
    with pytest.raises(SystemExit) as info:
        main(words)
    assert info.value.code == 2
    assert capsys.readouterr().err == line + "\n"  # no usage block before it


def test_the_help_summary_names_every_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    summary = " ".join(next(par for par in out.split("\n\n") if par.startswith("functrain: ")).split())  # wrapped
    named = summary.removeprefix("functrain: ").rstrip(".").split(", ")
    listed = out.split("{", 1)[1].split("}", 1)[0].split(",")  # argparse's "{train,inspect,...}"
    assert "rewind" in listed and "verify-resume" in listed
    assert named == listed
