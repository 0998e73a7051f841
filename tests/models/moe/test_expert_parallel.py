"""Expert parallelism (mesh.expert): configs/moe_char.yaml shrunk, trained 3 steps on 8 simulated CPU devices with
the experts split 4 ways and the batch 2 x 4 ways (the rows sent to their experts by the all-gathered exchange that
stands for the ragged all-to-all on CPU) ends within 1e-5 of one device; the expert layer split over fsdp x expert x
tensor gives one device's outputs and gradients; a capacity drops as data parallelism does."""

import json
import subprocess
import sys

import pytest

from functrain import fit
from functrain.checkpoint import load_params
from tests.conftest import REPO_ROOT, cli_env, max_abs_diff

TOLERANCE = 1e-5  # float32; the cross-device sums' order differs
TINY = {"model.hidden_size": 16, "model.intermediate_size": 16, "model.num_hidden_layers": 1,
        "model.num_attention_heads": 2, "model.num_key_value_heads": 2, "data.seq_len": 16,
        "data.global_batch_size": 8, "data.eval_fraction": 0.0, "optimizer.warmup_steps": 0, "train.max_steps": 3,
        "train.steps_per_call": 1, "eval.every_steps": 0, "checkpoint.every_steps": 0, "checkpoint.async_save": False,
        "log.every_steps": 1, "log.plot": False, "log.tensorboard": False, "log.progress": False}
# In an 8-device subprocess: ragged_all_to_all's documented example through the CPU exchange; the expert layer's
# outputs and gradients with its weights split over fsdp x expert x tensor against one device's; a capacity under
# expert parallelism against data parallelism over as many token shards; then the run below.
WORKER = """
import json, sys
from types import SimpleNamespace
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import functrain
from functrain.models.moe.dispatch import ExpertWeights, run_experts
from functrain.models.moe.expert_parallel import gathered_all_to_all
from functrain.parallel.sharding import make_mesh

out_dir, run_dir, overrides = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
results = {}
args = [[[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1]] * 2, [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]]]
pair = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
exchange = jax.shard_map(lambda *a: gathered_all_to_all(*(b[0] for b in a), axis_name="x")[None], mesh=pair,
                         in_specs=P("x"), out_specs=P("x"))
results["exchange"] = np.asarray(exchange(*(jax.device_put(np.array(a, np.int32), NamedSharding(pair, P("x")))
                                            for a in args))).tolist()

rng = np.random.default_rng(0)
x, logits = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
experts = np.argsort(-logits, axis=1)[:, :2].astype(np.int32)
weights = np.take_along_axis(np.asarray(jax.nn.softmax(logits)), experts, 1)
w = ExpertWeights(*(0.3 * rng.normal(size=shape).astype(np.float32) for shape in ((8, 8, 4), (8, 8, 4), (8, 4, 8))))
swiglu = lambda gate, up: jax.nn.silu(gate) * up

def layer(factor=None, **sizes):  # (outputs, selections dropped, gradients of the inputs and the weights)
    def loss(x, w):
        out, dropped = run_experts(x, weights, experts, np.ones(64, np.float32), w, swiglu, "grouped", factor)
        return (out * np.cos(np.arange(8))).sum(), (out, dropped.sum())
    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    if not sizes:
        return step(x, w)
    mesh = make_mesh(SimpleNamespace(**sizes))
    specs = ExpertWeights(P("expert", "fsdp", "tensor"), P("expert", "fsdp", "tensor"), P("expert", "tensor", "fsdp"))
    with jax.set_mesh(mesh):
        return step(x, jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), w, specs))

def relative(a, b):
    return max(float(np.abs(np.asarray(u) - np.asarray(v)).max() / np.abs(np.asarray(v)).max())
               for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

(grads, (out, _)), (mesh_grads, (mesh_out, _)) = layer(), layer(fsdp=2, expert=2, tensor=2)
results["composed"] = relative((mesh_out, mesh_grads), (out, grads))
(_, (by_experts, dropped)), (_, (by_data, data_dropped)) = layer(1.0, data=2, expert=4), layer(1.0, data=8)
results["capacity"] = [relative(by_experts, by_data), float(dropped), float(data_dropped)]
with open(out_dir + "/checks.json", "w") as file:
    json.dump(results, file)
functrain.fit("configs/moe_char.yaml", **{"run.dir": run_dir, **overrides, "mesh.data": 2, "mesh.expert": 4})
"""


def _losses(run_dir) -> list[float]:
    with open(f"{run_dir}/metrics.jsonl") as lines:
        return [record["loss"] for record in map(json.loads, lines) if record.get("split") == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    dirs = {"expert4_data2": str(root / "expert4_data2"), "single": str(root / "single")}
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(root), dirs["expert4_data2"], json.dumps(TINY)],
                            env=cli_env(8), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    fit("configs/moe_char.yaml", **{"run.dir": dirs["single"], **TINY, "mesh.data": 1})  # meanwhile
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    with open(root / "checks.json") as checks:
        return dirs, json.load(checks)


def test_expert_parallel_training_matches_one_device(runs):
    """3 steps with mesh.expert=4 mesh.data=2 on 8 devices end within 1e-5 of one device."""
    dirs, _ = runs
    reference = load_params(dirs["single"], step=3)
    assert max_abs_diff(reference, load_params(dirs["expert4_data2"], step=3)) <= TOLERANCE
    losses = zip(_losses(dirs["single"]), _losses(dirs["expert4_data2"]), strict=True)
    assert max(abs(a - b) for a, b in losses) <= TOLERANCE


def test_experts_split_over_fsdp_expert_and_tensor_give_one_devices_outputs_and_gradients(runs):
    assert runs[1]["composed"] <= 1e-6


def test_the_cpu_exchange_is_ragged_all_to_all(runs):
    """gathered_all_to_all (CPU) gives jax.lax.ragged_all_to_all's documented result (2 devices, ragged slices)."""
    assert runs[1]["exchange"] == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_a_capacity_drops_as_data_parallelism_over_as_many_shards_does(runs):
    """capacity_factor 1 with the experts split 4 ways (dropped selections not sent, the receive buffer bounded by
    the capacity) computes what 8-way data parallelism computes: the same selections dropped, the same outputs."""
    relative_difference, dropped, data_dropped = runs[1]["capacity"]
    assert dropped == data_dropped > 0 and relative_difference <= 1e-6


def test_the_steps_change_the_loss_far_beyond_the_tolerance(runs):
    """The comparison means something: three steps move the weights enough to move the loss."""
    losses = _losses(runs[0]["single"])
    assert len(losses) == 3 and abs(losses[0] - losses[-1]) > 100 * TOLERANCE
