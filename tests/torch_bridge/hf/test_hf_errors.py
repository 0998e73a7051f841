"""Bad HF directories and exports: one clear CheckpointError line each, nothing written to the destination."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from functrain.errors import CheckpointError, ConfigError
from torch_bridge.hf import hf_to_run_dir, read_params, save_pretrained
from torch_bridge.hf.architectures import architectures


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A valid tiny sharded Llama directory to break in different ways (copy it before editing)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=0,
                                      eos_token_id=0, pad_token_id=0)
    out = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(out, max_shard_size=3000)
    return out


def broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def assert_one_line_error(tmp_path: Path, hf_dir: Path, match: str, error=CheckpointError) -> None:
    """hf_to_run_dir fails with a one-line message and leaves the run directory absent."""
    run_dir = tmp_path / "run"
    with pytest.raises(error, match=match) as caught:
        hf_to_run_dir(str(hf_dir), str(run_dir))
    assert "\n" not in str(caught.value)
    assert not run_dir.exists()


def test_directory_without_weights(tmp_path, llama_dir):
    hf = tmp_path / "empty"
    hf.mkdir()
    shutil.copy(llama_dir / "config.json", hf)
    assert_one_line_error(tmp_path, hf, r"no weights in .*model\.safetensors")


def test_missing_config(tmp_path):
    (tmp_path / "hf").mkdir()
    assert_one_line_error(tmp_path, tmp_path / "hf", r"config\.json not found")


@pytest.mark.parametrize("model_type, nearest", [
    ("bert", ""), ("llava", " (nearest supported: 'llama')"), ("gemma3", " (nearest supported: 'gemma3_text')"),
    ("lama", " (nearest supported: 'llama')"), ("deepseek_v2", " (nearest supported: 'deepseek_v3')"),
    ("olmo2", " (nearest supported: 'olmo3')"),
])
def test_unsupported_model_type_names_the_nearest_and_the_supported_ones(tmp_path, llama_dir, model_type, nearest):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    supported = ", ".join(architectures())
    assert {"gpt2", "llama", "deepseek_v3"} <= set(supported.split(", "))
    assert_one_line_error(tmp_path, hf, re.escape(f"model_type {model_type!r} is not supported{nearest}; "
                                                  f"supported model types: {supported}"))


def test_truncated_safetensors_header(tmp_path, llama_dir):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:40])
    assert_one_line_error(tmp_path, hf, rf"{shard.name} is not a readable safetensors file")


def test_corrupt_safetensors_header(tmp_path, llama_dir):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:20] = b"not json!!!!"
    shard.write_bytes(bytes(data))
    assert_one_line_error(tmp_path, hf, rf"{shard.name} is not a readable safetensors file")


def test_shapes_contradicting_config(tmp_path, llama_dir):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "intermediate_size": 32}))
    assert_one_line_error(tmp_path, hf, r"gate_proj.weight has shape \[24, 16\] but config.json implies \[32, 16\]")


def test_index_naming_a_missing_file(tmp_path, llama_dir):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert_one_line_error(tmp_path, hf, rf"names {shard.name}, which does not exist")


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(tmp_path / "hf")
    from safetensors.numpy import save_file
    from torch_bridge.hf.reader import find_weights, stream
    tensors = dict(stream(find_weights(tmp_path / "hf")))
    tensors.pop("transformer.ln_f.bias")
    tensors["transformer.h.0.attn.extra.weight"] = np.zeros(3, np.float32)
    tensors["transformer.h.0.attn.bias"] = np.zeros(3, np.float32)  # allow-listed causal-mask buffer
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    assert_one_line_error(tmp_path, tmp_path / "hf",
                          r"missing transformer\.ln_f\.bias; unexpected transformer\.h\.0\.attn\.extra\.weight;")


def test_unsupported_activation_is_named(tmp_path, llama_dir):
    hf = broken_copy(llama_dir, tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "hidden_act": "mish"}))
    assert_one_line_error(tmp_path, hf, r"activation 'mish' is not supported", error=ConfigError)


def test_existing_run_dir_is_not_touched(tmp_path, llama_dir):
    assert hf_to_run_dir(str(llama_dir), str(tmp_path / "run")) == 0
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        hf_to_run_dir(str(llama_dir), str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_save_pretrained_writes_nothing_on_bad_params(tmp_path, llama_dir):
    params, config = read_params(llama_dir)
    params["layers_0"]["mlp"].pop("up_proj")
    with pytest.raises(CheckpointError, match="missing layers_0/mlp/up_proj/kernel"):
        save_pretrained(params, config, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_save_pretrained_refuses_a_non_empty_destination(tmp_path, llama_dir):
    params, config = read_params(llama_dir)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists and is not empty"):
        save_pretrained(params, config, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_bad_max_shard_size(tmp_path, llama_dir):
    params, config = read_params(llama_dir)
    with pytest.raises(CheckpointError, match="max_shard_size 'lots'"):
        save_pretrained(params, config, tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists()
