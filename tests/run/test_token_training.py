"""The token job end to end with nothing to download: Python's own standard-library sources are tokenized to
a byte store through the CLI; ``configs/gpt_tokens.yaml`` (packed documents) trains on it through the CLI
(``cli.main`` in this process); and two ``jax.distributed`` processes train on the store to the params of one."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, cli_env
from functrain.commands import cli
from functrain.checkpoint import load_params, params_digest

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64", "model.max_len=32",
        "data.seq_len=32", "data.global_batch_size=8", "train.max_steps=4", "train.steps_per_call=2",
        "log.every_steps=2", "log.tensorboard=false", "log.progress=false", "eval.every_steps=0",
        "data.eval_fraction=0", "checkpoint.every_steps=0", "optimizer.warmup_steps=0"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    out = tmp_path_factory.mktemp("token_training") / "store"
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    assert cli.main(["tokenize", *map(str, sources), str(out), "--workers", "1"]) == 0
    return out


def test_the_token_job_trains_on_stdlib_sources_through_the_cli(store, tmp_path):
    assert json.loads((store / "manifest.json").read_text())["num_docs"] == 40
    assert cli.main(["train", str(REPO_ROOT / "configs/gpt_tokens.yaml"), f"run.dir={tmp_path}",
                     f"data.path={store}", *TINY]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if row["split"] == "train"]
    assert len(losses) == 2 and np.all(np.isfinite(losses)) and losses[0] < np.log(256) + 0.5


def test_two_processes_on_the_store_train_to_the_params_of_one(store, tmp_path):
    """``--processes 2`` (one CPU device each, gloo) and one process of two devices read the same packed
    windows, slice them per process and end with the same params, bit for bit."""
    common = ["train", "configs/gpt_tokens.yaml", f"data.path={store}", *TINY]
    runs = {"two": ([*common, f"run.dir={tmp_path / 'two'}", "--processes", "2"], 1),
            "one": ([*common, f"run.dir={tmp_path / 'one'}"], 2)}
    procs = {name: subprocess.Popen([sys.executable, "-m", "functrain", *args], cwd=REPO_ROOT, text=True,
                                    env=cli_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for name, (args, devices) in runs.items()}
    for proc in procs.values():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
    two, one = load_params(tmp_path / "two"), load_params(tmp_path / "one")
    assert params_digest(two) == params_digest(one)
