"""A mixture of experts through the CLI: configs/moe_char.yaml (global-batch balancing over micro-batches, the
experts sharded over mesh.expert) resumes bitwise after a kill, bad MoE settings are one line and exit 2, and plan
names the expert kernel and exchange compiled for a TPU and counts the kernel's FLOPs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.commands.cli import main
from functrain.plan.counting import step_cost
from functrain.plan.planner import topology_devices
from tests.conftest import run_python

# moe_char shrunk to seconds; two micro-batches so the global-batch counting pass runs.
TINY = ["train.steps_per_call=2", "eval.every_steps=0", "model.hidden_size=16", "model.intermediate_size=16",
        "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=2",
        "data.seq_len=16", "data.global_batch_size=8", "train.micro_batches=2", "log.plot=false"]


def test_moe_char_resumes_bitwise_with_its_experts_sharded(tmp_path):
    """On 4 simulated devices with mesh.expert=4: the experts split 4 ways, each device's rows sent to them.
    verify-resume's check over 8 steps killed at a random call: the uninterrupted and resumed runs in one process
    of 4 devices, the SIGKILLed run in another."""
    overrides = [*TINY, "mesh.expert=4"]
    run_python(f"""
        from pathlib import Path
        import jax
        from tests.commands.test_verify_resume import assert_resumes_as_uninterrupted

        assert jax.device_count() == 4
        assert_resumes_as_uninterrupted("configs/moe_char.yaml", Path({str(tmp_path)!r}), 8, {overrides!r}, devices=4)
    """, devices=4)


@pytest.mark.parametrize("config, overrides, named", [
    ("configs/moe_char.yaml", ["model.num_experts_per_tok=9"], "num_experts_per_tok 9 is above num_local_experts 8"),
    ("configs/char_gpt.yaml", ["model.load_balance_scope=global_batch"], "mixture-of-experts"),
    ("configs/moe_char.yaml", ["model.load_balance_scope=global"], "load_balance_scope"),
    ("configs/moe_char.yaml", ["mesh.expert=3"], "mesh.expert=3 does not divide the model's 8 experts"),
    ("configs/char_gpt.yaml", ["mesh.expert=2"], "mesh.expert=2 applies to mixture-of-experts models"),
])
def test_bad_moe_settings_are_one_line_exit_2(tmp_path, capsys, config, overrides, named):
    status = main(["train", config, f"run.dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert named in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_plan_names_the_expert_kernel_and_exchange_compiled_for_a_tpu(capsys):
    """With the experts split over mesh.expert, the rows travel by XLA's ragged all-to-all on a TPU."""
    assert main(["plan", "configs/moe_char.yaml", *TINY, "mesh.expert=4", "--topology", "v5e:2x2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["experts"] == "ragged_dot kernel; rows sent to 4 expert shards by ragged all-to-all"
    assert report["fits"] is True and report["mesh"]["expert"] == 4
    assert report["model_flops_per_step"] > 0


def test_a_plan_counts_the_flops_of_the_tpu_s_grouped_matmul_kernel():
    """libtpu runs jax.lax.ragged_dot (the experts' matmuls) as a kernel of its own, whose FLOPs XLA's cost analysis
    does not see: the plan counts the cost estimate the kernel carries (Qwen3-30B-A3B was planned 2.9% low)."""
    rows, width, out, experts = 512, 256, 128, 4
    mesh = jax.sharding.Mesh(np.array(topology_devices("v5e:2x2")[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    shapes = [((rows, width), jnp.bfloat16), ((experts, width, out), jnp.bfloat16), ((experts,), jnp.int32)]
    args = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes]
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.lax.ragged_dot).lower(*args).compile()
    assert "ragged-dot" in compiled.as_text() and "tpu_custom_call" in compiled.as_text()
    matmul = 2 * rows * width * out  # each row multiplied by its own expert's weights
    assert matmul <= step_cost(compiled, steps_per_call=1)["flops"] < 1.1 * matmul
