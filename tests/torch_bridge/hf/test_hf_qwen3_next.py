"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (the Gated DeltaNet hybrids): logits parity with transformers both ways on tiny
random configs with every feature on (fused or separate Gated DeltaNet projections, grouped heads in both kinds of
layer, partial and scaled RoPE, M-RoPE's text settings, QKV biases, a custom layer pattern, experts with a shared
expert on some or all layers, tied heads), in several chunk sizes; bit-exact bf16 round trips through sharded
safetensors; the multi-token-prediction module left out in one log line; settings functrain does not implement
refused in one line, with nothing written."""

import copy
import json
import logging

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import functrain
from functrain.checkpoint import load_params
from functrain.commands.cli import main
from functrain.core.model_output import logits_of
from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.stacking import unstack_layers
from tests.torch_bridge.hf.test_hf_convert import hf_logits, hf_tensors, highest_precision, write_layout  # noqa: F401
from torch_bridge.hf import hf_to_run_dir, load_pretrained, read_params, save_pretrained

VOCAB = 64
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
HYBRID = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.1, rms_norm_eps=1e-5,
              max_position_embeddings=64)  # fmt: skip
EXPERTS = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2)
FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5_text": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}
CASES = {
    # A dense layer among the sparse ones, top-k weights not renormalised, biases, attention on every other layer,
    # half the head rotated by linearly scaled RoPE, the head tied.
    "qwen3_next": dict(EXPERTS, intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False, attention_bias=True,
                       layer_types=["linear_attention", "full_attention"] * 2, tie_word_embeddings=True,
                       rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=500.0,
                                            partial_rotary_factor=0.5)),
    "qwen3_5_text": dict(intermediate_size=40, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
        mrope_interleaved=True)),
    "qwen3_5_moe_text": dict(EXPERTS),
}


def build_hybrid(family: str, dtype=torch.float32, **change) -> transformers.PreTrainedModel:
    """A tiny random transformers model of ``family``; every weight perturbed off its initial value, by little
    enough that float32 rounding stays well under the 1e-5 the port is held to (at twice as much, transformers' own
    float32 logits are 2e-5 from its float64 ones)."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**HYBRID, **CASES[family], **change}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return model.to(dtype).eval()


def exact_hf_logits(model: transformers.PreTrainedModel) -> np.ndarray:
    """transformers' logits in float64 (its eager experts: the grouped matmul takes no float64): free of its own float32
    rounding (5e-6 here), the reference the port is held to in every chunk size."""
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("eager")
    with torch.no_grad():
        return exact(torch.tensor(IDS)).logits.numpy()


@pytest.mark.parametrize("family, layout", [
    ("qwen3_next", "safetensors_sharded"), ("qwen3_5_text", "safetensors"), ("qwen3_5_moe_text", "bin"),
])  # fmt: skip
def test_logits_match_transformers_both_ways(tmp_path, highest_precision, family, layout):
    model = build_hybrid(family)
    reference = hf_logits(model, IDS)
    write_layout(model, tmp_path / "in", layout)  # .bin: transformers' in-memory names (experts fused)
    apply_fn, params, config = load_pretrained(tmp_path / "in")
    assert config.name == family
    logits, exact = np.asarray(apply_fn(params, IDS)), exact_hf_logits(model)
    np.testing.assert_allclose(logits, reference, atol=1e-5, rtol=0)
    np.testing.assert_allclose(logits, exact, atol=1e-5, rtol=0)
    chunked = build_model(config.model_copy(update={"linear_chunk_size": 5}))  # 12 tokens: 3 chunks, one partial
    np.testing.assert_allclose(logits_of(jax.jit(chunked.apply)({"params": params}, IDS)), exact, atol=1e-5, rtol=0)

    out = save_pretrained(params, config, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is type(model)
    assert exported.config.layer_types == model.config.layer_types
    np.testing.assert_allclose(hf_logits(exported, IDS), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bf16_round_trip_through_shards_is_bit_exact(tmp_path, family):
    model = build_hybrid(family, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "in", max_shard_size=20000)
    params, config = read_params(tmp_path / "in")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    save_pretrained(params, config, tmp_path / "out", max_shard_size="20KB")
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    original, exported = hf_tensors(tmp_path / "in"), hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert np.array_equal(exported[name].view(np.int16), tensor.view(np.int16)), name
    config_json = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config_json["model_type"] == family and config_json["dtype"] == "bfloat16"
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").layer_types == model.config.layer_types


def test_a_bf16_sharded_checkpoint_converts_trains_scanned_and_exports_for_transformers(tmp_path, capsys):
    # Qwen3.5-MoE with a byte vocabulary (the bundled char_text data), saved by transformers in bf16 shards. Its layers
    # alternate, so the scan runs two groups of a Gated DeltaNet layer and an attention layer (the default pattern,
    # three linear layers to one, is one group: the train step compiled all four layers' bodies, three of them
    # chunked loops, in twice the time).
    model = build_hybrid("qwen3_5_moe_text", dtype=torch.bfloat16, vocab_size=256,
                         layer_types=["linear_attention", "full_attention"] * 2)
    model.save_pretrained(tmp_path / "hf", max_shard_size=20000)
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    result = functrain.fit(str(tmp_path / "run" / "config.yaml"), **{
        "model.scan_layers": True, "model.linear_chunk_size": 8, "data.seq_len": 16, "data.global_batch_size": 4,
        "data.eval_fraction": 0.0, "train.max_steps": 2, "optimizer.learning_rate": 1e-2, "log.progress": False,
        "log.tensorboard": False, "checkpoint.async_save": False})  # fmt: skip
    assert result.step == 2
    assert main(["convert", "functrain-to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--step", "2"]) == 0
    capsys.readouterr()
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported) is transformers.Qwen3_5MoeForCausalLM
    trained, config = load_params(str(tmp_path / "run"), step=2), read_params(tmp_path / "out")[1]
    ids = IDS * 4  # byte ids
    # Compiled whole: applied op by op, the 4 hybrid layers' chunked loops compile some 300 small programs.
    ours = logits_of(jax.jit(build_model(config).apply)({"params": unstack_layers(trained)}, ids))
    np.testing.assert_allclose(hf_logits(exported, ids), np.asarray(ours), atol=1e-4, rtol=0)
    assert np.abs(hf_logits(exported, ids) - hf_logits(model.float(), ids)).max() > 1e-2  # it trained


def test_the_multi_token_prediction_module_is_left_out_in_one_line(tmp_path, caplog):
    model = build_hybrid("qwen3_5_text")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["mtp.fc.weight"] = np.zeros((32, 64), np.float32)
    tensors["mtp.layers.0.input_layernorm.weight"] = np.zeros(32, np.float32)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        params, _ = read_params(tmp_path)
    assert "mtp" not in json.dumps(jax.tree.map(lambda leaf: None, params))
    [message] = [record.getMessage() for record in caplog.records]
    assert "left out the multi-token-prediction module mtp.* (2 tensors: mtp.fc.weight," in message


@pytest.mark.parametrize("family, change, named", [
    ("qwen3_next", dict(attention_dropout=0.1), "attention_dropout 0.1 is not supported for qwen3_next"),
    ("qwen3_5_text", dict(layer_types=["linear_attention", "sliding_attention"] * 2), "layer_types.1: Input should be"),
    ("qwen3_5_moe_text", dict(rope_parameters=dict(rope_type="proportional", rope_theta=1e4)),
     "rope type 'proportional' is not supported"),
    ("qwen3_5_text", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.1)),
     "gives 1 rotary dimensions"),
    ("qwen3_next", dict(hidden_act="tanh"), "activation 'tanh' is not supported"),
])  # fmt: skip
def test_unimplemented_settings_are_refused_in_one_line(tmp_path, family, change, named):
    build_hybrid(family).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    before = {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()}
    with pytest.raises(ConfigError, match=named) as caught:
        hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()
    assert {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()} == before
