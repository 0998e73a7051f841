"""Expert parallelism (mesh.expert): configs/moe_char.yaml shrunk, trained 3 steps on 8 simulated CPU devices with
the experts split 4 ways and the batch 2 x 4 ways (the rows sent to their experts by the all-gathered exchange that
stands for the ragged all-to-all on CPU) ends within 1e-5 of one device; so does FSDP x expert x tensor."""

import json

import pytest

from functrain import fit
from functrain.checkpoint import load_params
from tests.conftest import max_abs_diff, run_python

TOLERANCE = 1e-5  # float32; the cross-device sums' order differs
TINY = {"model.hidden_size": 16, "model.intermediate_size": 16, "model.num_hidden_layers": 1,
        "model.num_attention_heads": 2, "model.num_key_value_heads": 2, "data.seq_len": 16,
        "data.global_batch_size": 8, "data.eval_fraction": 0.0, "optimizer.warmup_steps": 0, "train.max_steps": 3,
        "train.steps_per_call": 1, "eval.every_steps": 0, "checkpoint.every_steps": 0, "checkpoint.async_save": False,
        "log.every_steps": 1, "log.plot": False, "log.tensorboard": False, "log.progress": False}
MESHES = {"expert4_data2": {"mesh.data": 2, "mesh.expert": 4},
          "fsdp2_expert2_tensor2": {"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2, "mesh.tensor": 2}}


def _losses(run_dir) -> list[float]:
    with open(f"{run_dir}/metrics.jsonl") as lines:
        return [record["loss"] for record in map(json.loads, lines) if record.get("split") == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("expert_parallel")
    dirs = {name: str(root / name) for name in [*MESHES, "single"]}
    run_python(f"""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec
        import functrain
        from functrain.models.moe.expert_parallel import gathered_all_to_all

        # jax.lax.ragged_all_to_all's documented example, on 2 devices.
        args = [[[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2, [[0, 1]] * 2, [[1, 2], [1, 1]], [[0, 0], [1, 2]],
                [[1, 1], [2, 1]]]
        mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
        exchange = jax.shard_map(lambda *a: gathered_all_to_all(*(b[0] for b in a), axis_name="x")[None],
                                 mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"))
        result = exchange(*(jax.device_put(np.array(a, np.int32), NamedSharding(mesh, PartitionSpec('x')))
                            for a in args))
        with open({str(root / "exchange.json")!r}, "w") as out:
            json.dump(np.asarray(result).tolist(), out)

        # A capacity under expert parallelism drops what data parallelism over as many token shards drops.
        from functrain.models.moe.dispatch import ExpertWeights, run_experts
        from types import SimpleNamespace
        from functrain.parallel.sharding import make_mesh
        rng = np.random.default_rng(0)
        x, logits = rng.normal(size=(64, 8)).astype(np.float32), rng.normal(size=(64, 8)).astype(np.float32)
        experts = np.argsort(-logits, axis=1)[:, :2].astype(np.int32)
        weights = np.take_along_axis(jax.nn.softmax(logits), experts, 1)
        w = ExpertWeights(*(rng.normal(size=shape).astype(np.float32) for shape in ((8, 8, 4), (8, 8, 4), (8, 4, 8))))
        def moe(**sizes):
            with jax.set_mesh(make_mesh(SimpleNamespace(**sizes))):
                return jax.jit(lambda *a: run_experts(*a, lambda gate, up: jax.nn.silu(gate) * up, "grouped", 1.0))(
                    x, weights, experts, np.ones(64, np.float32), w)
        (by_experts, dropped), (by_data, data_dropped) = moe(data=2, expert=4), moe(data=8)
        with open({str(root / "capacity.json")!r}, "w") as out:
            relative = np.abs(by_experts - by_data).max() / np.abs(by_data).max()
            json.dump([float(relative), float(dropped.sum()), float(data_dropped.sum())], out)
        for name, mesh in {MESHES!r}.items():
            functrain.fit("configs/moe_char.yaml", **{{"run.dir": {dirs!r}[name], **{TINY!r}, **mesh}})
    """, devices=8)
    dirs["exchange"], dirs["capacity"] = str(root / "exchange.json"), str(root / "capacity.json")
    fit("configs/moe_char.yaml", **{"run.dir": dirs["single"], **TINY, "mesh.data": 1})
    return dirs


@pytest.mark.parametrize("mesh", list(MESHES))
def test_expert_parallel_training_matches_one_device(runs, mesh):
    reference = load_params(runs["single"], step=3)
    assert max_abs_diff(reference, load_params(runs[mesh], step=3)) <= TOLERANCE
    assert max(abs(a - b) for a, b in zip(_losses(runs["single"]), _losses(runs[mesh]), strict=True)) <= TOLERANCE


def test_the_cpu_exchange_is_ragged_all_to_all(runs):
    """gathered_all_to_all (CPU) gives jax.lax.ragged_all_to_all's documented result (2 devices, ragged slices)."""
    with open(runs["exchange"]) as result:
        assert json.load(result) == [[1, 3, 0, 0], [2, 2, 4, 0]]


def test_a_capacity_drops_as_data_parallelism_over_as_many_shards_does(runs):
    """capacity_factor 1 with the experts split 4 ways (dropped selections not sent, the receive buffer bounded by
    the capacity) computes what 8-way data parallelism computes: the same selections dropped, the same outputs."""
    with open(runs["capacity"]) as result:
        relative_difference, dropped, data_dropped = json.load(result)
    assert dropped == data_dropped > 0 and relative_difference <= 1e-6


def test_the_steps_change_the_loss_far_beyond_the_tolerance(runs):
    """The comparison means something: three steps move the weights enough to move the loss."""
    losses = _losses(runs["single"])
    assert len(losses) == 3 and abs(losses[0] - losses[-1]) > 100 * TOLERANCE
