"""A mixture of experts through the CLI: configs/moe_char.yaml (global-batch balancing over micro-batches)
resumes bitwise after a kill, samples with ``generate``, and bad MoE settings are one line and exit 2."""

import json

import pytest

from functrain.commands.cli import main

# moe_char shrunk to seconds; two micro-batches so the global-batch counting pass runs.
TINY = ["train.steps_per_call=2", "eval.every_steps=0", "model.hidden_size=16", "model.intermediate_size=16",
        "model.num_hidden_layers=1", "model.num_attention_heads=2", "model.num_key_value_heads=2",
        "data.seq_len=16", "data.global_batch_size=8", "train.micro_batches=2", "log.plot=false"]


def test_moe_char_resumes_bitwise(capsys):
    assert main(["verify-resume", "configs/moe_char.yaml", "--steps", "8", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PASS") and "params sha256 equal" in out


@pytest.mark.parametrize("config, overrides, named", [
    ("configs/moe_char.yaml", ["model.num_experts_per_tok=9"], "num_experts_per_tok 9 is above num_local_experts 8"),
    ("configs/char_gpt.yaml", ["model.load_balance_scope=global_batch"], "mixture-of-experts"),
    ("configs/moe_char.yaml", ["model.load_balance_scope=global"], "load_balance_scope"),
])
def test_bad_moe_settings_are_one_line_exit_2(tmp_path, capsys, config, overrides, named):
    status = main(["train", config, f"run.dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert named in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


def test_plan_names_the_expert_kernel_compiled_for_a_tpu(capsys):
    assert main(["plan", "configs/moe_char.yaml", *TINY, "--topology", "v5e:2x2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["experts"] == "ragged_dot kernel" and report["fits"] is True
    assert report["model_flops_per_step"] > 0
