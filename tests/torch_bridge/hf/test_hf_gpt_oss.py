"""GPT-OSS against transformers' ``GptOssForCausalLM``: logits both ways on a tiny random model that exercises every
feature (sinks, sliding and full layers, YaRN, biased router and experts, the clamped SwiGLU with gate and up
interleaved on disk), MXFP4 checkpoints dequantized as transformers dequantizes them, and bad ones refused in one
line with exit status 2."""

import copy
import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from functrain.commands.cli import main
from functrain.errors import ConfigError
from functrain.models.configs.gpt_oss import GPT_OSS_YARN
from functrain.models.gpt_oss import from_hf_config, to_hf_config
from tests.torch_bridge.hf.test_hf_convert import IDS, VOCAB, hf_logits
from torch_bridge.hf import load_pretrained, read_params, save_pretrained

CONFIG = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, initializer_range=0.1,
    # A window of 4 bites on the 12-token input; full, sliding, full (not transformers' default order).
    sliding_window=4, layer_types=["full_attention", "sliding_attention", "full_attention"],
    # YaRN stretching the 8 original positions 4 times (attention factor 1 + 0.1 ln 4 on cos and sin).
    max_position_embeddings=32, rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0,
                                                     truncate=False, original_max_position_embeddings=8,
                                                     rope_theta=150000.0),
    swiglu_limit=0.5,  # small enough that the clamps bite
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
# openai/gpt-oss-20b's config.json as released (the old rope_scaling layout, MXFP4, keys transformers ignores).
RELEASED_20B = dict(
    architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
    experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
    initializer_range=0.02, intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
    max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
    num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
    pad_token_id=199999, quantization_config=MXFP4, rms_norm_eps=1e-05,
    rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                      rope_type="yarn", truncate=False),
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
    use_cache=True, vocab_size=201088,
)


def tiny_gpt_oss(**extra) -> transformers.GptOssForCausalLM:
    """A tiny random GPT-OSS, every weight perturbed (sinks, biases and norms far from their initial values)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**CONFIG, **extra}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def exact_hf_logits(model: transformers.PreTrainedModel) -> np.ndarray:
    """transformers' logits in float64 (its eager experts: the grouped matmul takes no float64), the reference a
    float32 port is held to."""
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("eager")
    with torch.no_grad():
        return exact(torch.tensor(IDS)).logits.numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt_oss") / "hf"
    tiny_gpt_oss().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def test_logits_match_transformers_both_ways(tmp_path, hf_dir, highest_precision):
    model = tiny_gpt_oss()
    reference = exact_hf_logits(model)
    apply_fn, params, config = load_pretrained(hf_dir)
    assert config.name == "gpt_oss" and [config.attention_window(i) for i in range(3)] == [None, 4, None]
    np.testing.assert_allclose(np.asarray(apply_fn(params, IDS)), reference, atol=1e-4, rtol=0)

    out = save_pretrained(params, config, tmp_path / "out")
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(Path(out) / "model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():  # gate and up interleaved again, as transformers stores them
        assert np.array_equal(exported[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded) is transformers.GptOssForCausalLM
    assert reloaded.config.layer_types == CONFIG["layer_types"]
    np.testing.assert_allclose(hf_logits(reloaded), hf_logits(model), atol=0, rtol=0)


def test_each_feature_changes_the_logits():
    """Each feature the parity test relies on moves this model's logits (else the parity would not test it)."""
    reference = hf_logits(tiny_gpt_oss())
    variants = {
        "no clamp": dict(swiglu_limit=1e6),
        "no window": dict(sliding_window=64),
        "no yarn": dict(rope_parameters=dict(rope_type="default", rope_theta=150000.0)),
        "no sinks": {},
    }
    for what, extra in variants.items():
        model = tiny_gpt_oss(**extra)  # the same weights: the seed and the shapes are the same
        if what == "no sinks":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.sinks.fill_(-1e4)
        assert np.max(np.abs(hf_logits(model) - reference)) > 1e-3, what


def write_mxfp4(hf_dir: Path, out: Path, blocks_shape=None) -> Path:
    """``hf_dir`` with its experts' weights replaced by random MXFP4 blocks and scales (the released layout:
    ``[E, out, in / 32, 16]`` and ``[E, out, in / 32]``) and config.json's ``quantization_config``."""
    tensors = load_file(hf_dir / "model.safetensors")
    rng = np.random.default_rng(0)
    for name in [name for name in tensors if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, columns, rows = tensors.pop(name).shape
        blocks = blocks_shape or (experts, rows, columns // 32, 16)
        tensors[name + "_blocks"] = rng.integers(0, 256, blocks, dtype=np.uint8)
        tensors[name + "_scales"] = rng.integers(120, 126, blocks[:-1], dtype=np.uint8)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4}))
    return out


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(tmp_path, hf_dir, highest_precision):
    quantized = write_mxfp4(hf_dir, tmp_path / "mxfp4")
    # Without triton (CPU) transformers dequantizes on load (integrations/mxfp4.py) into float32 parameters.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(quantized, dtype=torch.float32).eval()
    params, config = read_params(quantized)
    experts = params["layers_1"]["mlp"]["experts"]
    fused = theirs.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    assert experts["gate_proj"].dtype == ml_dtypes.bfloat16  # exact: every MXFP4 value is a bfloat16
    assert np.array_equal(experts["gate_proj"].astype(np.float32), fused[..., 0::2])
    assert np.array_equal(experts["up_proj"].astype(np.float32), fused[..., 1::2])
    assert np.array_equal(experts["down_proj"].astype(np.float32),
                          theirs.model.layers[1].mlp.experts.down_proj.detach().numpy())
    apply_fn, params, _ = load_pretrained(quantized)
    np.testing.assert_allclose(np.asarray(apply_fn(params, IDS)), exact_hf_logits(theirs), atol=1e-4, rtol=0)


def test_mxfp4_blocks_of_the_wrong_shape_are_refused_in_one_line(tmp_path, hf_dir, capsys):
    quantized = write_mxfp4(hf_dir, tmp_path / "mxfp4", blocks_shape=(4, 64, 2, 16))  # twice the groups
    assert main(["convert", "hf-to-functrain", str(quantized), str(tmp_path / "run")]) == 2
    message = capsys.readouterr().err.strip()
    assert message.count("\n") == 0 and "model.layers.0.mlp.experts.gate_up_proj_blocks has shape [4, 64, 2, 16] " \
        "but config.json implies [4, 64, 1, 16] (MXFP4 of model.layers.0.mlp.experts.gate_up_proj [4, 32, 64])" \
        in message
    assert not (tmp_path / "run").exists()


def test_another_quantization_is_refused_in_one_line(tmp_path, hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"quant_method 'awq' is not supported for gpt_oss \(only mxfp4"):
        from_hf_config({**config, "quantization_config": {"quant_method": "awq"}})


def test_the_released_config_reads_and_writes_back_as_transformers_reads_it():
    config = from_hf_config(RELEASED_20B)
    assert (config.num_local_experts, config.num_experts_per_tok, config.rope_theta) == (32, 4, 150000.0)
    assert [config.attention_window(i) for i in range(3)] == [128, None, 128]
    assert config.rope_scaling == GPT_OSS_YARN and config.decoder_shape().mlp_width == 4 * 2880
    theirs = transformers.GptOssConfig(**RELEASED_20B)
    exported = transformers.GptOssConfig(**to_hf_config(config))
    for key in ("rope_parameters", "layer_types", "num_local_experts", "sliding_window", "swiglu_limit", "head_dim",
                "router_aux_loss_coef", "attention_bias", "num_key_value_heads"):
        assert getattr(exported, key) == getattr(theirs, key), key
