"""Two torch.distributed (gloo) processes, each with half of every global batch, train like one process."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.conftest import free_port
from functrain.config.load import load_config
from functrain.run.backends import torch_backend as make_backend

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = ["data.global_batch_size=32", "train.micro_batches=2", "train.clip_norm=0.5", "train.epochs=null",
             "train.max_steps=4", "optimizer.warmup_steps=1"]

WORKER = """
import sys
import numpy as np
from functrain.config.load import load_config
from functrain.run.backends import torch_backend as make_backend
from tests.torch_bridge.test_torch_distributed import OVERRIDES, global_batches
config = load_config("configs/mlp_digits_torch.yaml", OVERRIDES)
batches = global_batches()
rank, rows = int(sys.argv[2]), 16
local = {k: v[:, rank * rows:(rank + 1) * rows] for k, v in batches.items()}
backend = make_backend(config, {k: v[0] for k, v in local.items()}, 4)
assert (backend.process_index, backend.process_count) == (rank, 2)
state, losses = backend.init_state(), []
for call in range(2):
    state, metrics = backend.train_call(state, {k: v[2 * call:2 * call + 2] for k, v in local.items()})
    losses += list(backend.to_host(metrics)["loss"])
np.savez(f"{sys.argv[1]}/rank{rank}.npz", losses=np.array(losses),
         **{name: value.numpy() for name, value in state.params.items()})
"""


def global_batches() -> dict[str, np.ndarray]:
    """Four global batches of 32 digit-like rows, one padding row each."""
    rng = np.random.default_rng(7)
    weight = np.ones((4, 32), np.float32)
    weight[:, 5] = 0.0
    return {"x": rng.random((4, 32, 64), dtype=np.float32), "y": rng.integers(0, 10, (4, 32)).astype(np.int32),
            "weight": weight}


def test_two_gloo_processes_match_one_process(tmp_path):
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(rank)], cwd=REPO,
                                env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for rank in range(2)]
    outputs = [worker.communicate(timeout=240)[0] for worker in workers]
    assert [w.returncode for w in workers] == [0, 0], outputs

    config = load_config(REPO / "configs" / "mlp_digits_torch.yaml", OVERRIDES)
    batches = global_batches()
    backend = make_backend(config, {k: v[0] for k, v in batches.items()}, 4)
    assert backend.process_count == 1
    state, metrics = backend.train_call(backend.init_state(), batches)
    ranks = [np.load(tmp_path / f"rank{rank}.npz") for rank in range(2)]
    np.testing.assert_allclose(ranks[0]["losses"], backend.to_host(metrics)["loss"], rtol=1e-5)
    for name, value in state.params.items():
        np.testing.assert_array_equal(ranks[0][name], ranks[1][name])  # the replicas never drift apart
        np.testing.assert_allclose(ranks[0][name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    assert not torch.equal(state.params["head.weight"], backend.init_state().params["head.weight"])
