"""User code through ``fit``: linen, NNX and plain-function models, user losses, optimizers and data objects.

Each example under ``examples/`` is killed mid-run and resumed (bitwise the same parameters and model state
as one uninterrupted run); a user loss accumulates exactly; an unannotated user model on an 8-device FSDP mesh
matches one device (default rule and pattern rules); the YAML ``target`` path equals the Python call.
"""

import importlib
import json
import signal
import subprocess
import sys

import jax
import functrain
import numpy as np
import pytest

from tests.conftest import REPO_ROOT, cli_env, max_abs_diff, run_python
from functrain.checkpoint.layout import checkpoints_dir, committed_steps
from functrain.commands.inspect import inspect_report
from tests.run.test_resume_bitwise import KILL_HOOKS

QUICK = {"train.steps_per_call": 5, "checkpoint.every_steps": 5, "log.every_steps": 5, "eval.every_steps": 0}
STEPS = 20

# Runs one example's main() under the kill hooks: argv = module, run dir, steps, overrides as JSON.
EXAMPLE_DRIVER = KILL_HOOKS + """
import importlib, json
importlib.import_module(sys.argv[1]).main(sys.argv[2], int(sys.argv[3]), **json.loads(sys.argv[4]))
"""


def _digest(run_dir) -> str:
    return next(line for line in inspect_report(run_dir, digest=True).splitlines() if line.startswith("sha256"))


# Linen with BatchNorm's model state and NNX (plain functions resume through the same path as linen's params).
@pytest.mark.parametrize("example", ["examples.nnx_model", "examples.flax_batchnorm"])
def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_params(tmp_path, example):
    run_dir = tmp_path / "run"
    # The attempt that is killed runs beside the uninterrupted reference (two cores, half the wait).
    proc = subprocess.Popen([sys.executable, "-c", EXAMPLE_DRIVER, example, str(run_dir), str(STEPS),
                             json.dumps(QUICK)], cwd=REPO_ROOT, env=cli_env(FT_KILL="call:4"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    module = importlib.import_module(example)
    reference = module.main(str(tmp_path / "reference"), STEPS, **QUICK)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, stderr[-3000:]
    assert committed_steps(checkpoints_dir(run_dir))[-1] >= 5  # killed inside steps 16-20, after saves
    result = module.main(str(run_dir), STEPS, **QUICK)
    assert result.step == STEPS
    assert _digest(run_dir) == _digest(tmp_path / "reference")
    # Batch statistics (linen BatchNorm, a state-updating loss_fn) resume bitwise too.
    resumed_state, reference_state = (jax.tree.leaves(r.state.model_state) for r in (result, reference))
    assert len(resumed_state) == len(reference_state)
    assert all(np.array_equal(a, b) for a, b in zip(resumed_state, reference_state))


def test_user_loss_accumulates_exactly(tmp_path):
    from examples import plain_functions
    whole = plain_functions.main(str(tmp_path / "whole"), 5)
    micro = plain_functions.main(str(tmp_path / "micro"), 5, **{"train.micro_batches": 4})
    assert whole.metrics["train"]["weight"] == 32.0
    assert max_abs_diff(whole.state.params, micro.state.params) < 1e-5


MESH_RUN = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, ".")
from examples import plain_functions
out = {}
rules = [{"pattern": "^w1$", "spec": [None, "fsdp"]}, {"pattern": "^w2$", "spec": ["fsdp"]}]
for name, extra in (("default", {}), ("patterns", {"mesh.param_rules": rules})):
    result = plain_functions.main(f"{RUN}/{name}", 5, **{"mesh.data": 1, "mesh.fsdp": 8, **extra})
    params = result.state.params
    out[name] = {"specs": {key: str(value.sharding.spec) for key, value in params.items()},
                 "params": {key: np.asarray(value).tolist() for key, value in params.items()}}
print(json.dumps(out))
"""


def test_unannotated_user_model_on_an_fsdp8_mesh_matches_one_device(tmp_path):
    from examples import plain_functions
    single = plain_functions.main(str(tmp_path / "single"), 5)
    proc = run_python(MESH_RUN.replace("{RUN}", str(tmp_path)), devices=8)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # Default rule: largest divisible dimension (the first on a tie); b2 (10 values) stays replicated.
    assert out["default"]["specs"] == {"w1": "P('fsdp',)", "b1": "P('fsdp',)", "w2": "P('fsdp',)", "b2": "P()"}
    assert out["patterns"]["specs"]["w1"] == "P(None, 'fsdp')" and out["patterns"]["specs"]["w2"] == "P('fsdp',)"
    for name in ("default", "patterns"):
        sharded = {key: np.asarray(value) for key, value in out[name]["params"].items()}
        assert max_abs_diff(sharded, dict(single.state.params)) < 1e-5


def test_hf_torch_and_grain_datasets_give_the_batches_of_a_dict_of_arrays():
    import datasets
    import grain
    import torch

    from functrain.data import BatchLoader, IndexSampler
    rng = np.random.default_rng(0)
    arrays = {"x": rng.random((37, 3), dtype=np.float32), "y": rng.integers(0, 5, 37).astype(np.int32)}

    class Records(torch.utils.data.Dataset):
        def __len__(self):
            return 37

        def __getitem__(self, index):
            return {"x": torch.from_numpy(arrays["x"][index]), "y": torch.tensor(arrays["y"][index])}

    hf = datasets.Dataset.from_dict(arrays).with_format("numpy")
    grain_records = grain.MapDataset.source([{name: value[i] for name, value in arrays.items()} for i in range(37)])
    sampler = IndexSampler(37, 8, seed=3)
    for process in (0, 1):
        loaders = [BatchLoader(data, sampler, process, 2, prefetch=0)
                   for data in (arrays, hf, Records(), grain_records)]
        for position in (0, 24, 40):  # 24 -> 32 drops the tail of epoch 0; 40 is in epoch 1
            expected, _ = loaders[0].host_batch(position)
            for loader in loaders[1:]:
                batch, _ = loader.host_batch(position)
                assert sorted(batch) == sorted(expected)
                for name in expected:
                    # Values, not dtypes: HF's numpy format hands int32 scalars back as int64.
                    np.testing.assert_array_equal(batch[name], expected[name])


YAML = """
model: {target: "examples.linen_hf_dataset:build_model", hidden: 64}
data: {target: "examples.linen_hf_dataset:load_data", global_batch_size: 32}
optimizer: {target: "optax:adamw", kwargs: {weight_decay: 0.0}, learning_rate: 0.003}
train: {max_steps: 5}
log: {every_steps: 5, progress: false}
"""


def test_yaml_targets_give_the_digest_of_the_python_call(tmp_path):
    from examples import linen_hf_dataset
    from functrain.commands import cli
    linen_hf_dataset.main(str(tmp_path / "python"), 5, **{"log.every_steps": 5})
    (tmp_path / "run.yaml").write_text(YAML)
    assert cli.main(["train", str(tmp_path / "run.yaml"), f"run.dir={tmp_path / 'yaml'}"]) == 0
    assert _digest(tmp_path / "yaml") == _digest(tmp_path / "python")


@pytest.mark.parametrize("name", ["adafactor", "lion", "muon"])
def test_named_optimizers_follow_the_schedule(name):
    import jax
    import optax
    from functrain.config.load import load_config
    from functrain.run.parts import make_optimizer
    config = load_config(base={"model": {"name": "mlp"}, "optimizer": {"name": name, "learning_rate": 0.1}})
    tx, schedule = make_optimizer(config.optimizer, total_steps=10)
    params = {"kernel": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)}
    updates, _ = tx.update(jax.tree.map(np.ones_like, params), tx.init(params), params)
    assert float(schedule(0)) == pytest.approx(0.1)
    assert all(float(np.max(np.abs(u))) > 0 for u in jax.tree.leaves(updates))
    assert float(optax.tree.norm(updates)) < 10.0


def test_a_fresh_run_traces_the_models_init_twice_once_for_shapes_and_once_compiled(tmp_path):
    # Every shape a build needs (the loss's checks, the train state, its shardings and logical axes) comes from one
    # abstract trace of init; the second trace is the compiled init of the fresh state. A large model's init takes
    # seconds to trace: a build once traced it four times.
    import flax.linen as nn

    traced = []

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x):
            if self.is_initializing():
                traced.append(1)
            return nn.Dense(3)(x)

    data = {"x": np.ones((8, 4), np.float32), "label": np.zeros(8, np.int32)}
    functrain.fit({"run": {"dir": str(tmp_path / "run")}, "data": {"global_batch_size": 4}, "train": {"max_steps": 1},
                   "eval": {"every_steps": 0}, "log": {"progress": False, "tensorboard": False, "plot": False}},
                  model=Counted(), train_data=data, inputs="x", labels="label")
    assert len(traced) == 2
