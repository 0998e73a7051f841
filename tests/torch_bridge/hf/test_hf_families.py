"""Qwen2/2.5, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3 (and the RoPE scaling types they use): logits parity with
transformers in both directions, bit-exact bf16 round trips, and strict config checks.

Each case is a tiny random transformers model whose window, head size or RoPE scaling actually changes the
logits for the 12-token test input (window 4-5, ``max_position_embeddings`` 8 for ``dynamic``).
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from functrain.errors import ConfigError
from torch_bridge.hf import hf_to_run_dir, load_pretrained, read_params, save_pretrained
from tests.torch_bridge.hf.test_hf_convert import IDS, LLAMA_CONFIG, hf_logits, hf_tensors, write_layout

FAMILIES = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
CASES = {
    "qwen2_sliding_upper_layers": ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    "qwen2_yarn_tied": ("qwen2", dict(tie_word_embeddings=True, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=16.0))),
    "qwen3_bias_headdim": ("qwen3", dict(head_dim=16, attention_bias=True)),
    "qwen3_sliding_linear": ("qwen3", dict(head_dim=8, use_sliding_window=True, sliding_window=5, max_window_layers=0,
                                           rope_scaling=dict(rope_type="linear", factor=2.0))),
    "mistral_window_headdim": ("mistral", dict(sliding_window=5, head_dim=12)),
    "llama_dynamic": ("llama", dict(max_position_embeddings=8, rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "phi3_fused_window": ("phi3", dict(sliding_window=5)),
    "phi3_longrope": ("phi3", dict(max_position_embeddings=32, original_max_position_embeddings=8, rope_scaling=dict(
        rope_type="longrope", short_factor=[1.0, 1.1, 1.2, 1.3], long_factor=[1.5, 2.0, 3.0, 4.0]))),
    # Caps small enough to bend the tiny model's scores and logits; global layer first to test layer_types.
    "gemma2_softcap_alternating": ("gemma2", dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=12,
                                                  attn_logit_softcapping=0.5, final_logit_softcapping=2.0,
                                                  layer_types=["full_attention", "sliding_attention"])),
    "gemma3_qk_norm_local_rope": ("gemma3_text", dict(
        head_dim=8, sliding_window=4, query_pre_attn_scalar=12, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}


def build_family_model(case: str, dtype=torch.float32) -> transformers.PreTrainedModel:
    """A tiny random model of ``case``'s family; weights perturbed so biases and norms are not 0/1."""
    family, extra = CASES[case]
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**LLAMA_CONFIG, **extra}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype).eval()


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("case, layout", [
    ("qwen2_sliding_upper_layers", "safetensors_sharded"), ("qwen2_yarn_tied", "bin"),
    ("qwen3_bias_headdim", "bin_sharded"), ("qwen3_sliding_linear", "safetensors"),
    ("mistral_window_headdim", "safetensors"), ("llama_dynamic", "safetensors"),
    ("phi3_fused_window", "bin_sharded"), ("phi3_longrope", "safetensors"),
    ("gemma2_softcap_alternating", "safetensors_sharded"), ("gemma3_qk_norm_local_rope", "bin"),
])
def test_logits_match_transformers_both_ways(tmp_path, highest_precision, case, layout):
    model = build_family_model(case)
    reference = hf_logits(model)
    write_layout(model, tmp_path / "in", layout)
    apply_fn, params, config = load_pretrained(tmp_path / "in")
    assert config.name == CASES[case][0]
    np.testing.assert_allclose(np.asarray(apply_fn(params, IDS)), reference, atol=1e-5, rtol=0)

    out = save_pretrained(params, config, tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is type(model)
    np.testing.assert_allclose(hf_logits(exported), reference, atol=1e-5, rtol=0)


def test_windows_follow_the_hf_layer_types():
    _, _, qwen2 = load_config_only("qwen2_sliding_upper_layers")
    assert [qwen2.attention_window(i) for i in range(2)] == [None, 4]
    _, _, mistral = load_config_only("mistral_window_headdim")
    assert [mistral.attention_window(i) for i in range(2)] == [5, 5]
    _, _, gemma = load_config_only("gemma2_softcap_alternating")
    assert [gemma.attention_window(i) for i in range(2)] == [None, 4]


def load_config_only(case: str):
    from torch_bridge.hf.pretrained import architecture_for
    hf = build_family_model(case).config.to_dict()
    arch = architecture_for(hf)
    return hf, arch, arch.model.from_hf_config(hf)


@pytest.mark.parametrize("case", ["qwen2_sliding_upper_layers", "qwen3_bias_headdim", "mistral_window_headdim",
                                  "phi3_longrope", "gemma2_softcap_alternating", "gemma3_qk_norm_local_rope"])
def test_bf16_round_trip_is_bit_exact(tmp_path, case):
    model = build_family_model(case, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "in")
    params, config = read_params(tmp_path / "in")
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
    save_pretrained(params, config, tmp_path / "out", max_shard_size="6KB")
    original, exported = hf_tensors(tmp_path / "in"), hf_tensors(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert np.array_equal(exported[name].view(np.int16), tensor.view(np.int16)), name
    _, arch, first = load_config_only(case)
    again = arch.model.from_hf_config(json.loads((tmp_path / "out" / "config.json").read_text()))
    assert arch.model.to_hf_config(again) == arch.model.to_hf_config(first)  # head_dim is written explicitly


@pytest.mark.parametrize("family, change, named", [
    ("qwen2", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, factor=2.0)), "longrope"),
    ("mistral", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0,
                                          original_max_position_embeddings=8, extrapolation_mode="x")),
     "extrapolation_mode"),
    ("qwen3", dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=2.0, beta_fast=3.0)), "beta_fast"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3_text", dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding layers support only the default rope"),
    ("phi3", dict(rope_parameters=dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0], long_factor=[1.0],
                                       original_max_position_embeddings=8)), "short_factor has 1 entries"),
])
def test_unimplemented_config_features_are_named(tmp_path, family, change, named):
    config_cls, model_cls = FAMILIES[family]
    model_cls(config_cls(**LLAMA_CONFIG)).save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    before = {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()}
    with pytest.raises(ConfigError, match=named) as caught:
        hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "run").exists()
    assert {path.name: path.read_bytes() for path in (tmp_path / "hf").iterdir()} == before
