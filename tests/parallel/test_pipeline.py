"""Pipeline parallelism (``mesh.pipeline``): a tiny GPT trained on 8 simulated devices with ``mesh.pipeline=4
mesh.data=2`` on the circular schedule (2 chunks a stage, fewer micro-batches than stages, gradient accumulation,
remat, 2 steps per call) equals one device; a pipelined run killed at a random call resumes bit for bit; its
checkpoint restores on one device (the stacked layers are saved in their logical order, whatever the stages).

Two processes of 8 devices one after the other (the pipelined run and the killed one; the resume); the
one-device reference and restore run here, beside them.
"""

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import pytest

import functrain
from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest
from functrain.parallel.pipeline import PIPELINE_AXIS, PipelineSchedule, bubble_fraction, iterations, pipeline_layers
from tests.conftest import REPO_ROOT, cli_env, max_abs_diff

TOLERANCE = 1e-5
TINY_GPT = {
    "model.n_layers": 8, "model.d_model": 32, "model.n_heads": 2, "model.d_ff": 64, "model.max_len": 16,
    "model.scan_layers": True, "data.seq_len": 16, "data.global_batch_size": 16, "data.eval_fraction": 0.0,
    "optimizer.warmup_steps": 0, "optimizer.schedule": "constant", "train.epochs": None, "train.steps_per_call": 2,
    "log.every_steps": 2, "log.tensorboard": False, "log.plot": False, "log.progress": False, "eval.every_steps": 0,
    "eval.samples.count": 0, "checkpoint.every_steps": 2, "checkpoint.keep": 5,
}
# 8 layers in 4 stages x 2 chunks of one layer; 2 micro-batches of 4 rows a step, each pipelined in 2 of 2 rows.
PIPELINED = {**TINY_GPT, "mesh.pipeline": 4, "mesh.data": 2, "pipeline.repeats": 2, "train.pipeline_microbatches": 2,
             "train.micro_batches": 2, "model.remat": "full"}
STEPS = 6

WORKER = r"""
import json, sys
import functrain
from functrain.commands.verify_resume import KillAt

for job in json.loads(sys.argv[1]):
    run_dir, max_steps, overrides, kill_step = job
    callbacks = [KillAt(kill_step)] if kill_step else []
    functrain.fit("configs/char_gpt.yaml", callbacks=callbacks, **{"run.dir": run_dir, "train.max_steps": max_steps,
                                                                   **overrides})
"""


def test_bubble_fraction_is_the_idle_share_of_the_schedule():
    assert bubble_fraction(4, 1, 4) == pytest.approx(3 / 7)  # (S - 1) / (M + S - 1): GPipe
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)  # (S - 1) / (R M + S - 1): circular
    assert bubble_fraction(1, 1, 4) == 0.0
    # Fewer micro-batches than stages: each repeat waits for the stages to come round.
    assert iterations(4, 2, 2) == 4 + 2 + 3 and bubble_fraction(4, 2, 2) == pytest.approx(1 - 4 / 9)


def _start(jobs: list) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), json.dumps(jobs)], cwd=REPO_ROOT,
                            env=cli_env(8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, killed: bool = False) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == (-9 if killed else 0), output
    return output


def _fit(run_dir: str, max_steps: int) -> None:
    functrain.fit("configs/char_gpt.yaml", **{**TINY_GPT, "run.dir": run_dir, "train.max_steps": max_steps,
                                              "mesh.data": 1})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    dirs = {name: str(root / name) for name in ("single", "pipelined", "killed", "one_device")}
    kill_step = random.choice(range(2, STEPS, 2))  # a call boundary before the end
    pipelined = _start([[dirs["pipelined"], STEPS, PIPELINED, None], [dirs["killed"], STEPS, PIPELINED, kill_step]])
    _fit(dirs["single"], STEPS + 2)
    _finish(pipelined, killed=True)
    killed_at = max(json.loads(line)["step"] for line in open(os.path.join(dirs["killed"], "metrics.jsonl")))
    resumed = _start([[dirs["killed"], STEPS, PIPELINED, None]])
    shutil.copytree(dirs["pipelined"], dirs["one_device"])
    _fit(dirs["one_device"], STEPS + 2)  # the pipelined run's last checkpoint, restored on one device
    _finish(resumed)
    return dirs, killed_at


def test_pipelined_training_matches_one_device(runs):
    dirs, _ = runs
    reference = load_params(dirs["single"], step=STEPS)
    assert max_abs_diff(reference, load_params(dirs["single"], step=2)) > 100 * TOLERANCE  # the params move
    assert max_abs_diff(reference, load_params(dirs["pipelined"], step=STEPS)) <= TOLERANCE


def test_a_killed_pipelined_run_resumes_bitwise(runs):
    dirs, killed_at = runs
    assert 2 <= killed_at < STEPS  # killed (exit -9, checked) before its end, then resumed
    final = params_digest(load_params(dirs["pipelined"], step=STEPS))
    assert params_digest(load_params(dirs["killed"], step=STEPS)) == final

    def losses(run_dir):
        return {line["step"]: line["loss"] for line in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))}

    assert losses(dirs["killed"]) == losses(dirs["pipelined"])


def test_a_pipelined_checkpoint_restores_on_one_device(runs):
    dirs, _ = runs
    assert max_abs_diff(load_params(dirs["single"], step=STEPS + 2), load_params(dirs["one_device"], step=STEPS + 2)) \
        <= TOLERANCE


def test_the_backward_pass_keeps_each_iterations_stage_inputs_not_every_layers(capsys):
    # 2 stages of 4 layers, 2 micro-batches of 2 rows: the loop's residuals hold the stages' inputs of each of its
    # 3 iterations, [3, 2 stages, 2 rows, width]; not the inputs of every layer of every iteration (4 times that).
    stages, layers, rows, width = 2, 8, 4, 16

    def loss(weights, x):
        def apply_group(w, h, args, index):
            return jax.checkpoint(lambda w, h: jnp.tanh(h @ w))(w, h), None

        return pipeline_layers(apply_group, weights, x, (), stages=stages, schedule=PipelineSchedule())[0].sum()

    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((stages,), (PIPELINE_AXIS,))):
        jax.ad_checkpoint.print_saved_residuals(loss, jnp.ones((layers, width, width)), jnp.ones((rows, width)))
    shapes = [[int(d) for d in dims.split(",")] for dims in re.findall(r"\[([\d,]+)\]", capsys.readouterr().out)]
    kept = sum(math.prod(shape) for shape in shapes if shape[-2:] == [rows // 2, width])
    assert kept == iterations(stages, 1, 2) * stages * (rows // 2) * width
