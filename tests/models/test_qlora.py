"""QLoRA: an HF directory converted straight into an NF4 base (bitsandbytes' codes), trained with LoRA adapters;
the base saved once and kept bit-identical; a run killed and resumed is bitwise the uninterrupted one; exported as
a PEFT directory that peft loads on the HF base (bitsandbytes-quantized: the same logits) and as a merged HF
directory; bad input is one line, exit 2, nothing written."""

import json
import shutil
import signal
import subprocess
import sys

import bitsandbytes
import bitsandbytes.functional as bnb
import flax.linen as nn
import jax
import numpy as np
import peft
import pytest
import torch
import transformers
import yaml
from flax.traverse_util import flatten_dict

import functrain
from functrain.checkpoint import load_params_and_meta
from functrain.checkpoint.reader import saved_tree_metadata
from functrain.commands.cli import main
from functrain.models import llama
from functrain.models.lora import adapter_interceptor
from tests.conftest import REPO_ROOT, cli_env
from tests.run.test_resume_bitwise import DRIVER, _digest, _train_losses
from tests.torch_bridge.hf.test_hf_finetune import IDS, tiny_llama_dir

TARGETS = ["q_proj", "v_proj", "down_proj"]
NF4 = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": TARGETS, "base_dtype": "nf4"}
# One step shape for every run of the module (the compiled train step is shared through the session's XLA cache).
SHORT = ["train.steps_per_call=1", "log.every_steps=1", "log.progress=false", "log.tensorboard=false",
         "data.seq_len=16", "data.global_batch_size=4", "data.eval_fraction=0", "checkpoint.async_save=false"]


def overrides(**extra):
    return [*SHORT, *(f"{key}={json.dumps(value)}" for key, value in extra.items())]


def qlora_llama_dir(path):
    """A byte-vocabulary Llama whose projections take 64 or 128 features (bitsandbytes' default block: 64)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """A tiny Llama converted into an NF4 base (step 0) and trained 3 steps, saving each."""
    tmp = tmp_path_factory.mktemp("qlora")
    qlora_llama_dir(tmp / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp / "hf"), str(tmp / "run"), "--base-dtype", "nf4"]) == 0
    shutil.copytree(tmp / "run" / "checkpoints" / "0", tmp / "base0")  # a clean step 0 for the kill test
    config = str(tmp / "run" / "config.yaml")
    assert main(["train", config, *overrides(**{"train.max_steps": 3, "checkpoint.every_steps": 1,
                                                "optimizer.learning_rate": 3e-2, "model.lora": NF4})]) == 0
    return tmp


def our_logits(run_dir, step):
    params, meta = load_params_and_meta(run_dir, step)
    config = llama.LlamaConfig(**meta["model"])
    with jax.default_matmul_precision("highest"), nn.intercept_methods(
            adapter_interceptor(config.lora, False, jax.random.PRNGKey(0))):
        return np.asarray(llama.build(config).apply({"params": params}, IDS))


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def test_the_converted_base_is_bitsandbytes_nf4_and_a_quarter_of_float32(qlora_run):
    params, meta = load_params_and_meta(qlora_run / "run", 0)
    assert meta["model"]["lora"]["base_dtype"] == "nf4" and "lora_a" not in str(flatten_dict(params))
    q_proj = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    weight = transformers.AutoModelForCausalLM.from_pretrained(qlora_run / "hf").model.layers[0].self_attn.q_proj.weight
    packed, state = bnb.quantize_4bit(weight.detach(), blocksize=64, compress_statistics=True, quant_type="nf4")
    np.testing.assert_array_equal(q_proj["nf4"].reshape(-1), packed.reshape(-1).numpy())
    assert {key: (value.shape, str(value.dtype)) for key, value in q_proj.items()} == {
        "nf4": ((64, 32), "uint8"), "absmax_codes": ((64, 1), "uint8"), "absmax_scale": ((1,), "float32"),
        "absmax_offset": ((), "float32")}
    flat = flatten_dict(params)
    quantized = {path for path in flat if "kernel" in path[:-1]}
    assert {path[1:-2] for path in quantized} == {("self_attn", name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        ("mlp", name) for name in ("gate_proj", "up_proj", "down_proj")}
    weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert sum(flat[path].nbytes for path in quantized) == weights // 2 + weights // 64 + 2 * 7 * (4 + 4)
    assert flat[("lm_head", "kernel")].dtype == np.float32  # the head stays in float, as bitsandbytes leaves it


def test_the_base_stays_bit_identical_and_later_steps_hold_the_adapters_only(qlora_run):
    base, _ = load_params_and_meta(qlora_run / "run", 0)
    trained, meta = load_params_and_meta(qlora_run / "run", 3)
    assert meta["lora_base_step"] == 0
    base, trained = flatten_dict(base), flatten_dict(trained)
    assert all(np.array_equal(trained[path], leaf) for path, leaf in base.items())
    saved = flatten_dict(saved_tree_metadata(qlora_run / "run" / "checkpoints" / "3", "params"))
    assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)
    assert all(np.any(leaf != 0) for path, leaf in trained.items() if path[-1] == "lora_b")


def test_killed_and_resumed_is_bitwise_identical(qlora_run):
    """From the converted NF4 base, one run straight through, one SIGKILLed after dispatching its 3rd step and
    resumed (in a subprocess): the same params digest and losses."""
    args = overrides(**{"train.max_steps": 4, "checkpoint.every_steps": 2, "model.lora": NF4})
    runs = {name: qlora_run / name for name in ("straight", "killed")}
    for run in runs.values():
        shutil.copytree(qlora_run / "base0", run / "checkpoints" / "0")
    config = str(qlora_run / "run" / "config.yaml")
    assert main(["train", config, f"run.dir={runs['straight']}", *args]) == 0
    killed = subprocess.run([sys.executable, "-c", DRIVER, "train", config, f"run.dir={runs['killed']}", *args],
                            cwd=REPO_ROOT, env=cli_env(FT_KILL="call:3"), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert json.loads((runs["killed"] / "checkpoints" / "2" / "meta" / "metadata").read_text())["lora_base_step"] == 0
    assert main(["train", config, f"run.dir={runs['killed']}", *args]) == 0
    assert _digest(runs["killed"]) == _digest(runs["straight"])
    straight = dict(_train_losses(runs["straight"]))
    assert sorted(straight) == [1, 2, 3, 4]
    assert all(loss == straight[step] for step, loss in _train_losses(runs["killed"]))


def test_peft_loads_the_adapters_on_the_hf_base_and_the_merged_export_is_the_model(qlora_run):
    """The PEFT directory on the dequantized base (exported from step 0) gives our logits; on the HF base quantized
    by bitsandbytes, the same but for the few absmax codes its CPU search rounds down (2e-3 here; 2e-6 without
    double quantization); on the original float base it loads as any adapter. The merged export (the dequantized
    base plus the adapters) gives our logits."""
    ours = our_logits(qlora_run / "run", 3)
    assert main(["convert", "functrain-to-hf", str(qlora_run / "run"), str(qlora_run / "adapter")]) == 0
    assert main(["convert", "functrain-to-hf", str(qlora_run / "run"), str(qlora_run / "base"), "--step", "0"]) == 0
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(qlora_run / "base").eval()
    np.testing.assert_allclose(hf_logits(peft.PeftModel.from_pretrained(dequantized, qlora_run / "adapter").eval()),
                               ours, atol=1e-5, rtol=0)
    nf4 = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                          bnb_4bit_compute_dtype=torch.float32)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(qlora_run / "hf", quantization_config=nf4,
                                                                  dtype=torch.float32)
    for module in quantized.modules():  # bitsandbytes' float32 product (its training path), not its CPU inference
        if isinstance(module, bitsandbytes.nn.Linear4bit):  # kernel's (which computes in bf16 on avx512bf16 CPUs)
            module.support_avx512bf16_for_cpu = False
    with_adapter = peft.PeftModel.from_pretrained(quantized, qlora_run / "adapter").eval()
    np.testing.assert_allclose(hf_logits(with_adapter), ours, atol=5e-3, rtol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(qlora_run / "hf").eval()
    assert np.isfinite(hf_logits(peft.PeftModel.from_pretrained(original, qlora_run / "adapter").eval())).all()

    assert main(["convert", "functrain-to-hf", str(qlora_run / "run"), str(qlora_run / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(qlora_run / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-5, rtol=0)


def test_a_float_base_is_quantized_as_it_is_restored_and_saved_once_quantized(tmp_path):
    """A run asking for an int8 base from a float conversion: its first save holds the base quantized, and the
    later ones name that step."""
    qlora_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    int8 = {"rank": 2, "targets": ["q_proj"], "base_dtype": "int8"}
    assert main(["train", str(tmp_path / "run" / "config.yaml"),
                 *overrides(**{"train.max_steps": 2, "checkpoint.every_steps": 1, "model.lora": int8})]) == 0
    first = flatten_dict(saved_tree_metadata(tmp_path / "run" / "checkpoints" / "1", "params"))
    assert ("layers_0", "mlp", "up_proj", "kernel", "int8") in first and ("lm_head", "kernel") in first
    _, meta = load_params_and_meta(tmp_path / "run", 2)
    assert meta["lora_base_step"] == 1


def bad_config(tmp_path, model):
    config = {"seed": 0, "run": {"dir": str(tmp_path / "run")}, "model": model,
              "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 4}, "train": {"max_steps": 1}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(config))
    return str(tmp_path / "bad.yaml")


MIXTRAL = {"name": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32, "num_local_experts": 4}
LLAMA = {"name": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}


@pytest.mark.parametrize("model,words", [
    (dict(MIXTRAL, lora={"base_dtype": "nf4", "block_size": 32}),
     "model.lora.base_dtype: nf4 cannot quantize layers_0/mlp/experts/"),
    (dict(LLAMA, lora={"base_dtype": "nf4"}),
     "model.lora.block_size: 64 does not divide the 32 input features of layers_0/"),
    (dict(LLAMA, lora={"rank": 0, "base_dtype": "nf4", "block_size": 32}), "model.lora.rank"),
    (dict(LLAMA, lora={"targets": ["q_proj", "qkv"], "base_dtype": "int8"}), "'qkv' matches no projection"),
    (dict(LLAMA, lora={"base_dtype": "int8", "double_quant": False}), "double_quant set the NF4 quantization"),
])
def test_bad_quantized_bases_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, model, words):
    assert main(["train", bad_config(tmp_path, model)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and words in err, err
    assert not (tmp_path / "run").exists()


def test_a_pre_quantized_hf_directory_or_a_stray_option_is_one_line_exit_2(tmp_path, capsys):
    tiny_llama_dir(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    for method in ("gptq", "awq", "bitsandbytes"):
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": method}}))
        assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"quantization_config is '{method}', a pre-quantized checkpoint" in err, err
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run"), "--block-size", "64"]) == 2
    assert "add --base-dtype nf4" in capsys.readouterr().err
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run"), "--base-dtype", "nf4"]) == 2
    assert "64 does not divide the 32 input features of layers_0/" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
