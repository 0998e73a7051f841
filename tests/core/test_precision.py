"""bfloat16 parameters (``train.param_dtype``) and the optimizer moment dtype (``optimizer.mu_dtype``): a small
model trains in them, checkpoints them as they are, and a resumed run ends bit-identical to an uninterrupted
one, also with the optimizer state offloaded (``train.offload_optimizer``) on the way. (An MLP: it compiles in
a fraction of a GPT's time; neither policy depends on the model.)"""

import json
import shutil

import jax
import numpy as np

import functrain
from functrain.parallel import offload
from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest

CONFIG = {
    "model": {"name": "mlp", "hidden": [32], "num_classes": 10},
    "data": {"name": "digits", "global_batch_size": 32, "eval_fraction": 0.0, "prefetch": 0},
    "optimizer": {"name": "adamw", "learning_rate": 0.01, "mu_dtype": "float32"},
    "train": {"max_steps": 30, "steps_per_call": 5, "param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
    "checkpoint": {"every_steps": 15, "async_save": False},
    "log": {"every_steps": 5, "progress": False},
}


def _losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if line["split"] == "train" and "loss" in line}


def test_bfloat16_params_train_and_resume_bitwise_with_or_without_offload(tmp_path, monkeypatch):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    result = functrain.fit(CONFIG, **{"run.dir": str(whole)})
    # The run as it was at step 15 (its last checkpoint then), resumed in a fresh fit: one compile fewer
    # than training the first half again. The resumed run keeps its optimizer state in pinned host memory,
    # which a CPU lists but refuses to offload to (the same RAM); forced here, the mechanism runs all the same.
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "30")
    monkeypatch.setattr(offload, "host_offload_available", lambda: True)
    offloaded = functrain.fit(CONFIG, **{"run.dir": str(resumed), "train.offload_optimizer": True})
    assert {leaf.sharding.memory_kind for leaf in jax.tree.leaves(offloaded.state.opt_state)} == {"pinned_host"}

    params = jax.tree.leaves(result.state.params)
    assert {leaf.dtype.name for leaf in params} == {"bfloat16"}
    moments = [leaf for leaf in jax.tree.leaves(result.state.opt_state) if np.ndim(leaf) >= 2]
    assert {leaf.dtype.name for leaf in moments} == {"float32", "bfloat16"}  # mu float32, nu as the params
    losses = _losses(whole)
    assert losses[30] < 0.8 * losses[5]
    assert params_digest(load_params(resumed, 30)) == params_digest(load_params(whole, 30))
    assert _losses(resumed) == losses
    assert {np.asarray(leaf).dtype.name for leaf in jax.tree.leaves(load_params(whole))} == {"bfloat16"}
