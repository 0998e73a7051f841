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
        import functrain
        for name, mesh in {MESHES!r}.items():
            functrain.fit("configs/moe_char.yaml", **{{"run.dir": {dirs!r}[name], **{TINY!r}, **mesh}})
    """, devices=8)
    fit("configs/moe_char.yaml", **{"run.dir": dirs["single"], **TINY, "mesh.data": 1})
    return dirs


@pytest.mark.parametrize("mesh", list(MESHES))
def test_expert_parallel_training_matches_one_device(runs, mesh):
    reference = load_params(runs["single"], step=3)
    assert max_abs_diff(reference, load_params(runs[mesh], step=3)) <= TOLERANCE
    assert max(abs(a - b) for a, b in zip(_losses(runs["single"]), _losses(runs[mesh]), strict=True)) <= TOLERANCE


def test_the_steps_change_the_loss_far_beyond_the_tolerance(runs):
    """The comparison means something: three steps move the weights enough to move the loss."""
    losses = _losses(runs["single"])
    assert len(losses) == 3 and abs(losses[0] - losses[-1]) > 100 * TOLERANCE
