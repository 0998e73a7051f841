"""DeepSeek-V3 checkpoints: released-style FP8 block-quantised weights dequantised on load exactly as transformers
dequantises them, and a multi-token-prediction layer config.json does not describe named in one line when it is left
out. The tiny random configs of ``CASES`` (latent attention with and without ``q_lora_rank``, YaRN's mscale,
group-limited routing, shared experts and ``first_k_dense_replace``) are checked against transformers both ways by
the registry's conversion module, test_hf_families.py."""

import json
import logging
import re

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from functrain.errors import CheckpointError, ConfigError
from functrain.models import deepseek_v3
from tests.torch_bridge.hf.test_hf_convert import hf_logits, highest_precision  # noqa: F401 (a fixture)
from torch_bridge.hf import load_pretrained, read_params, save_pretrained
from torch_bridge.hf.reader import find_weights, stream

VOCAB = 64
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
            n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=128, routed_scaling_factor=2.5)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0,
            mscale_all_dim=0.8, beta_fast=32.0, beta_slow=1.0)
CASES = {
    "q_lora_yarn": dict(rope_parameters=YARN),
    "no_q_lora_halves_wide_values": dict(q_lora_rank=None, rope_interleave=False, v_head_dim=20),
    "all_dense_tied": dict(first_k_dense_replace=3, tie_word_embeddings=True),
}


def build_deepseek(case: str, **change) -> transformers.DeepseekV3ForCausalLM:
    """A tiny random DeepSeek-V3; weights (and the correction bias) perturbed off their initial values."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**TINY, **CASES[case], **change}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                buffer.add_(0.3 * torch.randn_like(buffer))
    return model.eval()


# ------------------------------------------------------------------------------------------------ FP8

BLOCK = [16, 12]  # small blocks on small weights: several per matrix, partial ones at the edges


def _quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantisation: per block, scale_inv = max |w| / 448 and w / scale_inv in float8 e4m3."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale_inv = torch.empty(grid)
    quantized = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]]
            scale_inv[i, j] = block.abs().max() / 448.0
            quantized[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (
                block / scale_inv[i, j]
            ).to(torch.float8_e4m3fn)
    return quantized, scale_inv


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    # As released: every projection of attention and the MLPs; not the embeddings, the head, norms or routers.
    return tensor.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight"))


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory):
    """A DeepSeek-V3 directory as released: FP8 projections with their scales, and a multi-token-prediction
    layer (``model.layers.3``) past ``num_hidden_layers`` that config.json does not describe
    (``num_nextn_predict_layers`` 0: converting it is test_mtp.py's)."""
    model = build_deepseek("q_lora_yarn")
    directory = tmp_path_factory.mktemp("fp8")
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")  # per-expert names, as released
    state, reference = {}, {}
    for name, tensor in tensors.items():
        if _is_quantized(name, tensor):
            state[name], state[name + "_scale_inv"] = _quantized(tensor)
            reference[name] = _dequantize_fp8_weight(state[name], state[name + "_scale_inv"], BLOCK, torch.float32)
        else:
            state[name] = reference[name] = tensor.contiguous()
    for name in ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        state[f"model.layers.3.{name}"] = torch.ones(32)
    state["model.layers.3.eh_proj.weight"], state["model.layers.3.eh_proj.weight_scale_inv"] = _quantized(
        torch.randn(32, 64)
    )
    save_file(reference, directory / "model.safetensors", metadata={"format": "pt"})  # what the FP8 weights mean
    dequantized_model = transformers.DeepseekV3ForCausalLM.from_pretrained(directory).eval()
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK}
    config["num_nextn_predict_layers"] = 0
    (directory / "config.json").write_text(json.dumps(config))
    return directory, reference, hf_logits(dequantized_model, IDS)


def test_fp8_weights_dequantize_as_transformers_does(fp8_release, highest_precision, caplog):
    directory, reference, logits = fp8_release
    with caplog.at_level(logging.WARNING):
        apply_fn, params, config = load_pretrained(directory)
    dequantized = save_pretrained(params, config, directory.parent / "dequantized")
    exported = dict(stream(find_weights(dequantized)))
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.experts.3.up_proj.weight"):
        assert np.array_equal(exported[name], reference[name].numpy()), name
    assert all(np.array_equal(exported[name], tensor.numpy()) for name, tensor in reference.items())
    np.testing.assert_allclose(np.asarray(apply_fn(params, IDS)), logits, atol=1e-4, rtol=0)
    left_out = [record.getMessage() for record in caplog.records if "left out" in record.getMessage()]
    assert len(left_out) == 1 and "multi-token-prediction layer model.layers.3" in left_out[0]
    assert "5 tensors" in left_out[0]


def test_fp8_scales_that_do_not_fit_are_named(fp8_release, tmp_path):
    directory, _, _ = fp8_release
    state = load_file(directory / "model.safetensors")
    state["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"o_proj\.weight_scale_inv has shape \[1, 1\].*expected \[2, 4\]"):
        read_params(tmp_path)


@pytest.mark.parametrize("change, named", [
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not DeepSeek-V3's ('sigmoid')"),
    (dict(n_group=3), "n_routed_experts 8 is not a multiple of n_group 3"),
    (dict(num_experts_per_tok=6), "num_experts_per_tok 6 is more than the 4 experts of the topk_group 2 groups"),
    (dict(num_key_value_heads=2), "num_key_value_heads 2 must equal num_attention_heads 4"),
])
def test_configs_deepseek_v3_does_not_describe_are_one_line(tmp_path, change, named):
    build_deepseek("q_lora_yarn").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=re.escape(named)) as raised:
        read_params(tmp_path)
    assert "\n" not in str(raised.value) and str(raised.value).endswith("fix config.json")


def test_hf_config_round_trips():
    hf = build_deepseek("q_lora_yarn").config.to_dict()
    config = deepseek_v3.from_hf_config(hf)
    assert config.rope_scaling.mscale_all_dim == 0.8 and config.q_lora_rank == 24
    exported = deepseek_v3.to_hf_config(config)
    assert "bias_update_rate" not in exported and "load_balance_scope" not in exported
    assert deepseek_v3.from_hf_config(exported) == config
