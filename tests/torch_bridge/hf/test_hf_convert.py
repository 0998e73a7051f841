"""HF checkpoint conversion: logits parity with transformers, exact round trips, run-dir conversion.

Tiny random models are built with transformers from a config and saved in every supported layout
(safetensors or .bin, single file or sharded); functrain must reproduce their float32 logits to 1e-5.
"""

import copy
import json
from pathlib import Path

import flax.linen as nn
import jax
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from safetensors import safe_open

from functrain.checkpoint import load_params_and_meta
from functrain.models import gpt2, llama
from torch_bridge.hf import hf_to_run_dir, load_pretrained, read_params, run_dir_to_hf, save_pretrained
from torch_bridge.hf.reader import find_weights, stream

VOCAB = 96
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))

GPT2_CONFIG = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, initializer_range=0.1,
                   bos_token_id=0, eos_token_id=0)
LLAMA_CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, rms_norm_eps=1e-5,
                    bos_token_id=0, eos_token_id=0, pad_token_id=0)

CASES = {
    "gpt2": ("gpt2", {}),
    "gpt2_relu_inverse_idx": ("gpt2", dict(activation_function="relu", scale_attn_by_inverse_layer_idx=True)),
    "llama_gqa_untied": ("llama", dict(tie_word_embeddings=False, rope_theta=500.0)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_bias_headdim_llama3": ("llama", dict(
        attention_bias=True, mlp_bias=True, head_dim=12, num_key_value_heads=1,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8))),
}


def build_hf_model(arch: str, extra: dict, dtype=torch.float32) -> transformers.PreTrainedModel:
    """A tiny random HF model; weights are perturbed so biases and norms are not trivially 0/1."""
    torch.manual_seed(0)
    if arch == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**GPT2_CONFIG, **extra}))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**LLAMA_CONFIG, **extra}))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype).eval()


def hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray = IDS) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def exact_hf_logits(model: transformers.PreTrainedModel, ids: np.ndarray = IDS) -> np.ndarray:
    """transformers' logits computed in float64: the reference a float32 port is held to, free of torch's own
    float32 kernel choices (CPU matmul and attention paths vary with threads and CPU features)."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(torch.tensor(ids)).logits.numpy()


def save_bin(model: transformers.PreTrainedModel, out: Path, shards: int = 1, legacy_gpt2: bool = False) -> None:
    """Save as pytorch_model.bin (or shards + index), the format transformers 5 no longer writes."""
    model.config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if legacy_gpt2:  # the original OpenAI export: no "transformer." prefix, causal-mask buffers saved
        state = {k.removeprefix("transformer."): v for k, v in state.items()}
        for i in range(model.config.n_layer):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32, dtype=torch.bool))
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    if shards == 1:
        torch.save(state, out / "pytorch_model.bin")
        return
    names = list(state)
    weight_map = {}
    for i, chunk in enumerate(np.array_split(np.arange(len(names)), shards), start=1):
        file_name = f"pytorch_model-{i:05d}-of-{shards:05d}.bin"
        torch.save({names[j]: state[names[j]] for j in chunk}, out / file_name)
        weight_map.update({names[j]: file_name for j in chunk})
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


LAYOUTS = ["safetensors", "safetensors_sharded", "bin", "bin_sharded"]


def write_layout(model: transformers.PreTrainedModel, out: Path, layout: str) -> None:
    if layout == "safetensors":
        model.save_pretrained(out)
    elif layout == "safetensors_sharded":
        model.save_pretrained(out, max_shard_size=8000)
        assert (out / "model.safetensors.index.json").exists()
    else:
        save_bin(model, out, shards=3 if layout == "bin_sharded" else 1,
                 legacy_gpt2=isinstance(model, transformers.GPT2LMHeadModel))


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.mark.parametrize("case, layout", [  # every model case and every file layout, not their product
    ("gpt2", "safetensors"), ("gpt2_relu_inverse_idx", "bin_sharded"), ("llama_gqa_untied", "safetensors_sharded"),
    ("llama_tied", "bin"), ("llama_bias_headdim_llama3", "safetensors"),
])
def test_logits_match_transformers(tmp_path, highest_precision, case, layout):
    arch, extra = CASES[case]
    model = build_hf_model(arch, extra)
    write_layout(model, tmp_path, layout)
    apply_fn, params, config = load_pretrained(tmp_path)
    assert config.name == arch
    logits = np.asarray(apply_fn(params, IDS))
    assert logits.dtype == np.float32 and logits.shape == (*IDS.shape, VOCAB)
    np.testing.assert_allclose(logits, exact_hf_logits(model), atol=1e-5, rtol=0)


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    return dict(stream(find_weights(directory)))


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa_untied", "llama_bias_headdim_llama3"])
def test_hf_to_functrain_to_hf_is_identical(tmp_path, highest_precision, case):
    arch, extra = CASES[case]
    model = build_hf_model(arch, extra)
    model.save_pretrained(tmp_path / "in")
    apply_fn, params, config = load_pretrained(tmp_path / "in")
    out = save_pretrained(params, config, tmp_path / "out", max_shard_size="6KB")
    original, exported = hf_tensors(tmp_path / "in"), hf_tensors(Path(out))
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and np.array_equal(exported[name], tensor), name
    assert (Path(out) / "model.safetensors.index.json").exists()
    with safe_open(str(next(Path(out).glob("model-00001-of-*.safetensors"))), framework="np") as handle:
        assert handle.metadata() == {"format": "pt"}
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_logits(reloaded), hf_logits(model), atol=0, rtol=0)
    assert not list(tmp_path.glob(".out.partial-*"))  # the staging directory is gone


@pytest.mark.parametrize("arch, layout", [("llama", "safetensors_sharded"), ("gpt2", "bin")])
def test_bf16_round_trip_is_bit_exact(tmp_path, arch, layout):
    model = build_hf_model(arch, CASES[arch if arch == "gpt2" else "llama_gqa_untied"][1], dtype=torch.bfloat16)
    write_layout(model, tmp_path / "in", layout)
    params, config = read_params(tmp_path / "in")
    leaves = jax.tree.leaves(params)
    assert {leaf.dtype for leaf in leaves} == {np.dtype(ml_dtypes.bfloat16)}  # no float32 detour
    save_pretrained(params, config, tmp_path / "out")
    exported = hf_tensors(tmp_path / "out")
    original = {k: v for k, v in model.state_dict().items() if k in exported}
    assert len(original) == len(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == ml_dtypes.bfloat16
        assert np.array_equal(exported[name].view(np.int16), tensor.view(torch.int16).numpy()), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_run_dir_round_trip_loads_in_transformers(tmp_path, highest_precision):
    model = build_hf_model("llama", CASES["llama_gqa_untied"][1], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    assert hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run")) == 0
    assert (tmp_path / "run" / "checkpoints" / "0").is_dir()

    from functrain.config.load import load_config
    config = load_config(tmp_path / "run" / "config.yaml")
    assert config.model.name == "llama" and config.model.num_key_value_heads == 2

    out = run_dir_to_hf(str(tmp_path / "run"), str(tmp_path / "back"), None)
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert exported.dtype == torch.float32  # run dirs keep float32 master weights; bf16 widens exactly
    # Reference: the bf16 checkpoint loaded in float32 (a bf16 model's .float() would keep bf16-rounded RoPE).
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    np.testing.assert_array_equal(hf_logits(exported), hf_logits(reference))
    with pytest.raises(Exception, match="no checkpoint for step 5"):
        run_dir_to_hf(str(tmp_path / "run"), str(tmp_path / "other"), 5)
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("module, cfg", [
    (gpt2, gpt2.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2)),
    (llama, llama.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, attention_bias=True)),
])
def test_params_carry_logical_axis_names(module, cfg):
    model = module.build(cfg)
    boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 4), np.int32)))["params"]
    specs = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    names = {name for spec in specs for name in spec}
    assert names <= {"embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "norm", None}
    assert {"embed", "vocab", "norm", "heads", "mlp"} <= names
    kernels = {path: leaf for path, leaf in jax.tree_util.tree_leaves_with_path(
        boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))}
    assert all(isinstance(leaf, nn.Partitioned) for leaf in kernels.values())
    assert {leaf.dtype for leaf in jax.tree.leaves(nn.meta.unbox(boxed))} == {np.dtype(np.float32)}


@pytest.mark.parametrize("case", ["gpt2", "llama_bias_headdim_llama3"])
def test_hf_config_round_trips_through_transformers(case):
    arch, extra = CASES[case]
    hf_config = build_hf_model(arch, extra).config.to_dict()
    module = gpt2 if arch == "gpt2" else llama
    config = module.from_hf_config(hf_config)
    again = transformers.AutoConfig.for_model(**module.to_hf_config(config)).to_dict()
    assert module.from_hf_config(again) == config


def test_bfloat16_compute_stays_close(tmp_path):
    build_hf_model("llama", CASES["llama_gqa_untied"][1]).save_pretrained(tmp_path)
    apply32, params, _ = load_pretrained(tmp_path)
    apply16, _, _ = load_pretrained(tmp_path, dtype=jax.numpy.bfloat16)
    p, q = jax.nn.log_softmax(apply32(params, IDS)), jax.nn.log_softmax(apply16(params, IDS))
    assert apply16(params, IDS).dtype == np.float32
    kl = float(np.mean(np.sum(np.exp(p) * (p - q), axis=-1)))
    assert 0 < kl <= 0.015  # MaxText's bf16 parity bar


def test_placement_streams_each_tensor_onto_its_sharding(tmp_path, python_runner):
    build_hf_model("llama", CASES["llama_gqa_untied"][1]).save_pretrained(tmp_path, max_shard_size=8000)
    proc = python_runner(f"""
        import flax.linen as nn, jax, numpy as np
        from jax.sharding import Mesh
        from torch_bridge.hf import load_pretrained, place_with_shardings
        from torch_bridge.hf.architectures import architectures
        from torch_bridge.hf.pretrained import read_params
        params_np, config = read_params({str(tmp_path)!r})
        model = architectures()["llama"].model.build(config)
        boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), np.zeros((1, 4), np.int32)))["params"]
        mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("fsdp", "tensor"))
        rules = [("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"),
                 ("vocab", "tensor"), ("norm", None), ("head_dim", None)]
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
        placed = []
        def spy(path, array):
            placed.append(path)
            assert isinstance(array, np.ndarray)
            return place_with_shardings(shardings)(path, array)
        apply_fn, params, _ = load_pretrained({str(tmp_path)!r}, place=spy)
        kernel = params["layers_0"]["mlp"]["gate_proj"]["kernel"]
        assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor"), kernel.sharding
        assert kernel.addressable_shards[0].data.shape == (16, 24)  # (32, 48) split 2 x 2
        assert len(placed) == len(jax.tree.leaves(params))
        with jax.default_matmul_precision("highest"):
            ids = np.arange(24).reshape(2, 12) % {VOCAB}
            ref = load_pretrained({str(tmp_path)!r})
            np.testing.assert_allclose(apply_fn(params, ids), ref[0](ref[1], ids), atol=1e-5)
        print("OK", len(placed))
    """, devices=4)
    assert "OK" in proc.stdout


def test_a_blocking_save_writes_numpy_params_without_a_second_copy(tmp_path):
    """Orbax's defensive deep copy would hold a second copy of the params during the save."""
    import tracemalloc

    from torch_bridge.hf import run_store
    params = {"a": {"kernel": np.ones((1024, 1024), np.float32)}, "b": np.ones((1024, 1024), np.float32)}
    model_bytes = params["a"]["kernel"].nbytes + params["b"].nbytes
    tracemalloc.start()
    try:
        run_store.save(tmp_path, 0, params, {"model": {"name": "x"}})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < model_bytes / 2, peak
    loaded, _ = load_params_and_meta(tmp_path, 0)
    assert np.array_equal(loaded["b"], params["b"])
