"""Training on 8 simulated devices (FSDP, data parallel, data x fsdp x tensor) matches one device, and a
checkpoint saved on one mesh resumes on another.

Two subprocesses run side by side: one with 8 devices (four runs), one with 1 device (the reference).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO_ROOT, max_abs_diff, xla_flags
from functrain.checkpoint import load_params

TOLERANCE = 1e-5  # float32; only the order of cross-device sums differs

WORKER = r"""
import json, sys
import functrain

def run(run_dir, max_steps, mesh):
    overrides = {"run.dir": run_dir, "train.max_steps": max_steps, "train.epochs": None,
                 "train.steps_per_call": 1, "log.every_steps": 1, "log.tensorboard": False,
                 "log.progress": False, "eval.every_steps": 0, "checkpoint.every_steps": 0,
                 "checkpoint.async_save": False, "data.eval_fraction": 0.0, **mesh}
    result = functrain.fit("configs/mlp_digits.yaml", **overrides)
    assert result.step == max_steps, result.step

for run_dir, max_steps, mesh in json.loads(sys.argv[1]):
    run(run_dir, max_steps, mesh)
"""

MESHES = {
    "fsdp8": {"mesh.data": 1, "mesh.fsdp": 8, "mesh.tensor": 1},
    "data8": {"mesh.data": 8, "mesh.fsdp": 1, "mesh.tensor": 1},
    "mixed": {"mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
}


def _start(runs: list, devices: int) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), json.dumps(runs)], cwd=REPO_ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_runs")
    dirs = {name: str(root / name) for name in [*MESHES, "single"]}
    sharded = [[dirs[name], 4, mesh] for name, mesh in MESHES.items()]
    # Resume the FSDP checkpoint of step 4 on the data x fsdp x tensor mesh and train to step 6.
    sharded.append([dirs["fsdp8"], 6, MESHES["mixed"]])
    single = [[dirs["single"], 4, {"mesh.data": 1}], [dirs["single"], 6, {"mesh.data": 1}]]
    procs = [_start(sharded, 8), _start(single, 1)]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output
    return dirs




@pytest.mark.parametrize("mesh", list(MESHES))
def test_sharded_training_matches_one_device(runs, mesh):
    reference = load_params(runs["single"], step=4)
    sharded = load_params(runs[mesh], step=4)
    initial_change = max_abs_diff(reference, load_params(runs["single"], step=6))
    assert initial_change > 100 * TOLERANCE  # the params really move, so the comparison means something
    assert max_abs_diff(reference, sharded) <= TOLERANCE


def test_checkpoint_from_fsdp_mesh_resumes_on_another_mesh(runs):
    assert max_abs_diff(load_params(runs["single"], step=6), load_params(runs["fsdp8"], step=6)) <= TOLERANCE
