"""A GRPO job of two processes (``functrain train --processes 2``, gloo collectives) computes what one process with
two devices computes: each process samples, scores and trains the completions of its own prompts (the loader's
slice) on its own device, and the batch's advantages, normalisers and metrics come from every process's rewards.
So the completions, the metrics and the final weights are equal bit for bit, and only process 0 writes. Also with
multi-turn episodes, where every process samples a turn while any process has an episode open, here sampled a step
ahead (grpo.async_steps). The single-turn job of two processes samples with the paged sampler (``grpo.sampler:
paged``, three decode slots refilled from the queue), the one-process job with the dense one: both draw the same
tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, cli_env
from tests.run.test_multiprocess import _cli
from functrain.checkpoint import load_params, params_digest

COMMON = ["train.max_steps=2", "log.every_steps=1", "checkpoint.every_steps=0", "log.plot=false", "log.tensorboard=false",
          "log.progress=false"]
RUNS = {
    # The bundled example's prompts and rewards (and its reference) on a smaller GPT from random weights: two steps of
    # one prompt per process.
    "single_turn": ["configs/grpo_char_gpt.yaml", "train.init_from=null", "model.n_layers=1", "model.d_model=64",
                    "model.d_ff=128", "data.global_batch_size=16", "grpo.max_completion_length=8"],
    # The guessing game's episodes (examples/guess_digit_env.py): one game per process, up to four turns; sampled one
    # step ahead (asynchronous GRPO: the second step's games played with the first step's weights while it trains,
    # the third's held by the final checkpoint, one array over both processes).
    "episodes": ["configs/grpo_guess_digit.yaml", "model.n_layers=1", "data.global_batch_size=16",
                 "grpo.async_steps=1"],
}
TWO_PROCESSES_ONLY = {"single_turn": ["grpo.sampler=paged", "grpo.decode_slots=3"], "episodes": []}


# Both one-process runs in one interpreter of two devices (one start-up less), each through the CLI's entry point.
ONE_PROCESS = """
import json, sys
from functrain.commands.cli import main
for argv in json.loads(sys.argv[1]):
    assert main(argv) == 0, argv
"""


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run directories of every run with one process of two devices: started at once, each test waits for them
    beside its own two-process job."""
    root = tmp_path_factory.mktemp("one_process")
    jobs = [["train", config, f"run.dir={root / run}", *overrides, *COMMON]
            for run, (config, *overrides) in RUNS.items()]
    proc = subprocess.Popen([sys.executable, "-c", ONE_PROCESS, json.dumps(jobs)], cwd=REPO_ROOT, env=cli_env(2),
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def run_dir(run: str) -> Path:
        if proc.returncode is None:
            output, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, output
        assert proc.returncode == 0, "the one-process runs failed (see the first test that waited for them)"
        return root / run

    yield run_dir
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("run", list(RUNS))
def test_two_processes_sample_score_and_train_as_one_process_with_two_devices(tmp_path, run, one_process):
    config, *overrides = RUNS[run]
    two = tmp_path / "two_processes"
    paged = TWO_PROCESSES_ONLY[run]
    proc = _cli(["train", config, f"run.dir={two}", *overrides, *paged, *COMMON, "--processes", "2"])
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    one = one_process(run)
    assert params_digest(load_params(two)) == params_digest(load_params(one))
    timings = {"samples_per_sec", "steps_per_sec"}
    metrics = [[{key: value for key, value in line.items() if key not in timings}
                for line in _lines(run / "metrics.jsonl") if line["split"] == "train"] for run in (two, one)]
    assert [line["step"] for line in metrics[0]] == [1, 2]
    assert metrics[0] == metrics[1]  # rewards, lengths, loss, KL, the logprob gap: every process's rows counted
    assert _lines(two / "samples.jsonl") == _lines(one / "samples.jsonl")  # process 0's first prompt, once
