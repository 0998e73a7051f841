"""Pipeline parallelism (``mesh.pipeline``): a tiny GPT trained on 8 simulated devices with ``mesh.pipeline=4
mesh.data=2`` on the circular schedule (2 chunks a stage, fewer micro-batches than stages, gradient accumulation,
remat, 2 steps per call) equals one device; a pipelined run killed at a random call resumes bit for bit; its
checkpoint restores on one device (the stacked layers are saved in their logical order, whatever the stages).
A tiny DeepSeek-V3 (a dense first layer outside the pipeline, then 2 MoE layers) trained with ``mesh.pipeline=2
mesh.expert=2 mesh.data=2``, its router z-loss in the loss and its correction biases moved by the step's expert
counts, equals one device: the router statistics and counts are carried through the schedule and summed over its
micro-batches.

Two processes of 8 devices one after the other (the pipelined runs and the killed one; the resume); the
one-device references and restore run here, beside them.
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
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

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
# One dense layer run whole on both stages, then one MoE layer a stage; 8 rows a step pipelined in 2 micro-batches of
# 4 rows, each split 4 ways over data x expert (the experts 2 ways).
DEEPSEEK = {"seed": 0, "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 8, "eval_fraction": 0.0},
            "model": {"name": "deepseek_v3", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 24,
                      "moe_intermediate_size": 8, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                      "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": None,
                      "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4, "n_routed_experts": 8,
                      "n_shared_experts": 0, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
                      "max_position_embeddings": 16, "bias_update_rate": 0.01, "initializer_range": 0.2,
                      "router_z_loss_coef": 0.01, "scan_layers": True},
            "optimizer": {"name": "adamw", "learning_rate": 0.01, "warmup_steps": 0},
            "train": {"max_steps": 3, "steps_per_call": 1},
            "eval": {"every_steps": 0, "samples": {"count": 0}}, "checkpoint": {"every_steps": 3, "async_save": False},
            "log": {"every_steps": 1, "plot": False, "tensorboard": False, "progress": False}}
EXPERTS_PIPELINED = {"mesh.pipeline": 2, "mesh.expert": 2, "mesh.data": 2}

WORKER = r"""
import json, sys
import functrain
from functrain.commands.verify_resume import KillAt

for job in json.loads(sys.argv[1]):
    config, run_dir, max_steps, overrides, kill_step = job
    callbacks = [KillAt(kill_step)] if kill_step else []
    functrain.fit(config, callbacks=callbacks, **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})
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
    names = ("single", "pipelined", "killed", "one_device", "deepseek_single", "deepseek_pipelined")
    dirs = {name: str(root / name) for name in names}
    kill_step = random.choice(range(2, STEPS, 2))  # a call boundary before the end
    gpt = "configs/char_gpt.yaml"
    pipelined = _start([[DEEPSEEK, dirs["deepseek_pipelined"], 3, EXPERTS_PIPELINED, None],
                        [gpt, dirs["pipelined"], STEPS, PIPELINED, None],
                        [gpt, dirs["killed"], STEPS, PIPELINED, kill_step]])
    _fit(dirs["single"], STEPS + 2)
    functrain.fit(DEEPSEEK, **{"run.dir": dirs["deepseek_single"]})
    _finish(pipelined, killed=True)
    killed_at = max(json.loads(line)["step"] for line in open(os.path.join(dirs["killed"], "metrics.jsonl")))
    resumed = _start([[gpt, dirs["killed"], STEPS, PIPELINED, None]])
    shutil.copytree(dirs["pipelined"], dirs["one_device"])
    _fit(dirs["one_device"], STEPS + 2)  # the pipelined run's last checkpoint, restored on one device
    _finish(resumed)
    return dirs, killed_at


def test_pipelined_training_matches_one_device(runs):
    dirs, _ = runs
    reference = load_params(dirs["single"], step=STEPS)
    assert max_abs_diff(reference, load_params(dirs["single"], step=2)) > 100 * TOLERANCE  # the params move
    assert max_abs_diff(reference, load_params(dirs["pipelined"], step=STEPS)) <= TOLERANCE


def _train_records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as lines:
        return [record for record in map(json.loads, lines) if record.get("split") == "train"]


def test_a_pipelined_mixture_of_experts_with_its_bias_update_matches_one_device(runs):
    dirs, _ = runs
    reference, pipelined = load_params(dirs["deepseek_single"], step=3), load_params(dirs["deepseek_pipelined"], step=3)
    assert max_abs_diff(reference, pipelined) <= TOLERANCE
    biases = [leaf for path, leaf in flatten_dict(reference).items() if path[-1] == "e_score_correction_bias"]
    assert len(biases) == 1 and np.abs(biases[0]).max() > 0.005  # the 2 MoE layers' biases moved by the counts
    for single, split in zip(_train_records(dirs["deepseek_single"]), _train_records(dirs["deepseek_pipelined"]),
                             strict=True):
        assert single["moe/z_loss"] > 0 and split["moe/z_loss"] == pytest.approx(single["moe/z_loss"], abs=TOLERANCE)
        assert split["loss"] == pytest.approx(single["loss"], abs=TOLERANCE)


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
