"""Throughput in the logs: the analytic FLOPs formula against XLA's own count, and what a train log line holds."""

import json
import logging
from types import SimpleNamespace

import jax
import numpy as np
import optax
import pytest

from functrain import fit
from functrain.config.load import load_config
from functrain.report.mfu import SpeedReport, peak_tflops, speed_report, train_flops_per_token
from functrain.core.state import TrainState
from functrain.core.step import make_train_step
from functrain.models import build_model
from functrain.core.program import as_program

SEQ, BATCH = 128, 8
MODELS = {
    "gpt": {"name": "gpt", "vocab_size": 512, "max_len": SEQ, "d_model": 256, "n_layers": 2, "n_heads": 4,
            "d_ff": 1024},
    "llama_gqa": {"name": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
                  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "max_position_embeddings": SEQ},
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_flops_formula_matches_xla_cost_analysis_of_the_train_step(name):
    config = load_config(None, [f"data.seq_len={SEQ}"], base={"model": MODELS[name], "data": {"name": "array_file"}})
    batch = {"tokens": np.zeros((BATCH, SEQ + 1), np.int32), "weight": np.ones(BATCH, np.float32)}
    program = as_program(build_model(config.model), batch)
    tx = optax.adamw(1e-3)
    state = TrainState.create(program.init(jax.random.PRNGKey(0))[0], tx, jax.random.PRNGKey(1))
    cost = jax.jit(make_train_step(program.loss_fn, tx, stateful=True)).lower(state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # XLA executes the dense masked attention, so compare with the full count; norms, softmax and the
    # optimizer update are the few percent the formula leaves out.
    analytic = train_flops_per_token(config.model.decoder_shape(), SEQ, attention="full") * BATCH * SEQ
    assert 0.95 < analytic / cost["flops"] <= 1.0
    causal = train_flops_per_token(config.model.decoder_shape(), SEQ)
    assert causal < analytic / (BATCH * SEQ)


def test_train_log_lines_carry_tokens_per_second_and_model_flops(tmp_path):
    fit("configs/char_gpt.yaml", **{"run.dir": str(tmp_path / "r"), "train.max_steps": 4, "train.steps_per_call": 2,
                                    "log.every_steps": 2, "eval.every_steps": 0, "checkpoint.every_steps": 0,
                                    "model.d_model": 32, "model.d_ff": 64, "model.n_layers": 1,
                                    "data.seq_len": 16, "data.global_batch_size": 4, "log.progress": False})
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["split"] == "train"]
    for line in train:
        assert line["tokens_per_sec"] == pytest.approx(line["steps_per_sec"] * 4 * 16)
        assert line["samples_per_sec"] == pytest.approx(line["steps_per_sec"] * 4)
        assert line["tokens_per_sec_per_device"] == pytest.approx(line["tokens_per_sec"] / jax.device_count())
        assert line["model_tflops_per_sec_per_device"] > 0
        assert "mfu" not in line  # a CPU has no known peak


def test_mfu_is_model_flops_over_the_devices_peak():
    report = SpeedReport(samples_per_step=8, tokens_per_step=8 * 1024, flops_per_token=1e9, devices=4,
                         peak_flops_per_device=989e12)
    fields = report.fields(steps_per_sec=10.0)
    assert fields["tokens_per_sec"] == 81920 and fields["tokens_per_sec_per_device"] == 20480
    assert fields["mfu"] == pytest.approx(1e9 * 20480 / 989e12)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("cpu") is None


def test_an_accelerator_without_a_known_peak_is_named_in_a_warning(caplog):
    model = load_config(None, [], base={"model": MODELS["gpt"]}).model
    device = SimpleNamespace(device_kind="Mystery Accelerator X1", platform="gpu")
    with caplog.at_level(logging.WARNING, logger="functrain"):
        report = speed_report(model.decoder_shape(), SEQ, 8, [device])
    assert report.flops_per_token and report.peak_flops_per_device is None
    assert "'Mystery Accelerator X1'" in caplog.text and "MFU is not reported" in caplog.text
    assert "mfu" not in report.fields(1.0) and "model_tflops_per_sec_per_device" in report.fields(1.0)


def test_the_maxtext_configs_count_flops_as_maxtext_published_them():
    # MaxText's tiering: Llama 2 70B on v5p, 692 tokens/s/chip ("approx") at 65.4% MFU (docs/plan.md).
    llama2 = load_config("configs/llama2_70b.yaml", []).model.decoder_shape()
    mfu = 692 * train_flops_per_token(llama2, 4096) / (peak_tflops("TPU v5p") * 1e12)
    assert mfu == pytest.approx(0.654, abs=0.01)
    # Llama 3.1 405B: 405.85B parameters, of which 2.1B are the input embedding (not a matmul).
    llama3 = load_config("configs/llama3_405b.yaml", []).model.decoder_shape()
    assert train_flops_per_token(llama3, 0) / 6 == pytest.approx(405.85e9 - 128256 * 16384, rel=1e-3)
