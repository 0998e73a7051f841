"""QLoRA end to end, on one run shared by the module: a tiny Llama converted straight into an NF4 base
(bitsandbytes' codes) and trained 50 steps from the initial adapters of peft + bitsandbytes 0.50 (its CPU path),
on the same batches: the losses agree with that reference step for step within TOLERANCE. The base is saved once
and kept bit-identical; a run that fails and resumes is bitwise the uninterrupted one; the adapters export as a
PEFT directory that peft loads on the HF base (bitsandbytes-quantized too) and as a merged HF directory; bad input
is one line, exit 2, nothing written."""

import json
import shutil

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
from flax.traverse_util import flatten_dict, unflatten_dict

import functrain
from functrain.checkpoint import load_params_and_meta
from functrain.checkpoint.reader import saved_tree_metadata
from functrain.commands.cli import main
from functrain.commands.plan import format_plan
from functrain.core.precision import is_quantized
from functrain.models import llama
from functrain.models.lora import adapter_interceptor
from functrain.models.quantized import quantize_int8
from functrain.parallel.sharding import human_bytes
from functrain.plan.planner import plan
from functrain.run import jax_backend
from functrain.run.fit import resolve_config
from tests.run.test_resume_bitwise import _digest, _train_losses
from tests.torch_bridge.hf.test_hf_finetune import IDS, tiny_llama_dir
from torch_bridge.hf import run_store

STEPS, BATCH, LENGTH, LEARNING_RATE, SAVE_EVERY = 50, 2, 16, 1e-2, 25
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 8, "alpha": 16.0, "targets": TARGETS, "base_dtype": "nf4"}
# Measured: 7.2e-5 at most (at the last step; 5e-7 at the first; the loss falls from 5.55 to 5.06). Both compute
# in float32; what separates them is the order of float32 sums (torch's kernels, XLA's) and the few absmax codes of
# the double quantization that bitsandbytes' CPU search rounds to the lower neighbour (functrain/models/quantized.py).
TOLERANCE = 2e-4
# The NF4 base's bytes: 4 bits a weight, an 8-bit absmax code per 64, a float32 scale and offset per projection.
WEIGHTS = 64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3
QUANTIZED_BASE_BYTES = WEIGHTS // 2 + WEIGHTS // 64 + 7 * (4 + 4)
NF4 = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)


def qlora_llama_dir(path):
    """A byte-vocabulary Llama whose projections take 64 or 128 features (bitsandbytes' default block: 64)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )).save_pretrained(path)


def bitsandbytes_base(hf_dir):
    """The HF model quantized by bitsandbytes, computing in float32 (its training path: its CPU inference kernel
    computes in bf16 on avx512bf16 CPUs)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, quantization_config=NF4, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, bitsandbytes.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


def reference_losses(hf_dir, tokens):
    """peft + bitsandbytes QLoRA: the losses of its 50 AdamW steps, and its initial adapters by module name."""
    model = peft.get_peft_model(bitsandbytes_base(hf_dir), peft.LoraConfig(
        r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=0.0, target_modules=TARGETS))
    initial = {name.removeprefix("base_model.model.model."): (module.lora_A["default"].weight.detach().numpy().T.copy(),
                                                              module.lora_B["default"].weight.detach().numpy().T.copy())
               for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.LoraLayer)}
    trained = [parameter for parameter in model.parameters() if parameter.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(STEPS):
        batch = torch.tensor(tokens[step * BATCH:(step + 1) * BATCH], dtype=torch.long)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return np.array(losses), initial


def start_from(converted, run, initial):
    """``run``'s step 0: the converted base of ``converted`` with the reference's initial adapters (a restored LoRA
    step keeps the adapters it holds)."""
    params, meta = load_params_and_meta(converted, 0)
    flat = flatten_dict(params, is_leaf=lambda _, node: is_quantized(node))
    for name, (lora_a, lora_b) in initial.items():
        _, layer, block, projection = name.split(".")
        flat[(f"layers_{layer}", block, projection, "lora_a")] = lora_a
        flat[(f"layers_{layer}", block, projection, "lora_b")] = lora_b
    run.mkdir()
    saved = {key: value for key, value in meta.items() if key not in ("step", "time", "format_version", "versions")}
    run_store.save(run, 0, unflatten_dict(flat), saved)


def run_overrides(tmp, run, steps=STEPS, save_every=SAVE_EVERY, lora=LORA):
    """The module's run at ``run``: ``steps`` on the module's batches with adapters ``lora``, saving every
    ``save_every`` steps."""
    return {
        "run.dir": str(run), "train.max_steps": steps, "data.name": "array_file",
        "data.path": str(tmp / "tokens.npz"), "data.shuffle": False, "data.seq_len": LENGTH,
        "data.global_batch_size": BATCH, "data.eval_fraction": 0.0, "optimizer.learning_rate": LEARNING_RATE,
        "model.lora": lora, "train.matmul_precision": "highest", "log.every_steps": 1, "log.progress": False,
        "log.tensorboard": False, "checkpoint.every_steps": save_every, "checkpoint.async_save": False}


def fit(tmp, run, steps=STEPS, save_every=SAVE_EVERY, lora=LORA, converted="converted"):
    """Train ``run`` (from its step 0) as :func:`run_overrides` says, with the config of the conversion in
    ``tmp / converted``."""
    return functrain.fit(str(tmp / converted / "config.yaml"), **run_overrides(tmp, run, steps, save_every, lora))


def fail_then_resume(monkeypatch, failing_call, fit_run):
    """``fit_run()`` with its ``failing_call``-th train call raising (the machine going away), then again."""
    real_call, calls = jax_backend.JaxBackend.train_call, []

    def failing(self, state, batches):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("the machine went away")
        return real_call(self, state, batches)

    monkeypatch.setattr(jax_backend.JaxBackend, "train_call", failing)
    with pytest.raises(RuntimeError, match="went away"):
        fit_run()
    monkeypatch.undo()
    fit_run()


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """The module's run: converted to NF4 (``converted``), started from the reference's adapters and trained 50
    steps (``run``, a clean copy of its step 0 in ``start``); the reference's losses."""
    tmp = tmp_path_factory.mktemp("qlora")
    qlora_llama_dir(tmp / "hf")
    # Rising byte sequences (steps of 1 to 3): something to learn in 50 steps.
    steps = np.random.default_rng(0).integers(1, 4, (STEPS * BATCH, LENGTH + 1))
    np.savez(tmp / "tokens.npz", tokens=(np.cumsum(steps, axis=1) % 256).astype(np.int32))
    reference, initial = reference_losses(tmp / "hf", np.load(tmp / "tokens.npz")["tokens"])
    assert main(["convert", "hf-to-functrain", str(tmp / "hf"), str(tmp / "converted"), "--base-dtype", "nf4"]) == 0
    start_from(tmp / "converted", tmp / "run", initial)
    shutil.copytree(tmp / "run", tmp / "start")
    fit(tmp, tmp / "run")
    return tmp, reference


def our_logits(run_dir, step):
    params, meta = load_params_and_meta(run_dir, step)
    config = llama.LlamaConfig(**meta["model"])
    with jax.default_matmul_precision("highest"), nn.intercept_methods(
            adapter_interceptor(config.lora, False, jax.random.PRNGKey(0))):
        return np.asarray(jax.jit(llama.build(config).apply)({"params": params}, IDS))


def hf_logits(model):
    with torch.no_grad():
        return model.eval()(torch.tensor(IDS)).logits.numpy()


def test_fifty_steps_match_peft_and_bitsandbytes_step_for_step(qlora):
    tmp, reference = qlora
    ours = np.array([loss for _, loss in _train_losses(tmp / "run")])
    assert len(ours) == STEPS and reference[-1] < reference[0] - 0.3  # it learned
    np.testing.assert_allclose(ours, reference, atol=TOLERANCE, rtol=0)


def test_the_converted_base_is_bitsandbytes_nf4_and_a_quarter_of_float32(qlora):
    tmp, _ = qlora
    params, meta = load_params_and_meta(tmp / "converted", 0)
    assert meta["model"]["lora"]["base_dtype"] == "nf4" and "lora_a" not in str(flatten_dict(params))
    q_proj = params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    weight = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").model.layers[0].self_attn.q_proj.weight
    packed, _ = bnb.quantize_4bit(weight.detach(), blocksize=64, compress_statistics=True, quant_type="nf4")
    np.testing.assert_array_equal(q_proj["nf4"].reshape(-1), packed.reshape(-1).numpy())
    assert {key: (value.shape, str(value.dtype)) for key, value in q_proj.items()} == {
        "nf4": ((64, 32), "uint8"), "absmax_codes": ((64, 1), "uint8"), "absmax_scale": ((1,), "float32"),
        "absmax_offset": ((), "float32")}
    flat = flatten_dict(params)
    quantized = {path for path in flat if "kernel" in path[:-1]}
    assert {path[1:-2] for path in quantized} == {("self_attn", name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        ("mlp", name) for name in ("gate_proj", "up_proj", "down_proj")}
    assert sum(flat[path].nbytes for path in quantized) == QUANTIZED_BASE_BYTES
    assert flat[("lm_head", "kernel")].dtype == np.float32  # the head stays in float, as bitsandbytes leaves it


def test_the_base_is_saved_once_and_stays_bit_identical(qlora):
    tmp, _ = qlora
    base, _ = load_params_and_meta(tmp / "run", 0)
    trained, meta = load_params_and_meta(tmp / "run", STEPS)
    assert meta["lora_base_step"] == 0
    base, trained = flatten_dict(base), flatten_dict(trained)
    assert all(np.array_equal(trained[path], leaf) for path, leaf in base.items() if path[-1] not in ("lora_a", "lora_b"))
    for step in (SAVE_EVERY, STEPS):
        saved = flatten_dict(saved_tree_metadata(tmp / "run" / "checkpoints" / str(step), "params"))
        assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)
    assert all(np.any(leaf != 0) for path, leaf in trained.items() if path[-1] == "lora_b")


def test_a_float_base_is_quantized_as_it_is_restored_and_saved_once_quantized(qlora):
    """A QLoRA run from a float conversion: its first save holds the base quantized (bitsandbytes' codes, as a
    quantized conversion stores them), and the later ones name that step."""
    tmp, _ = qlora
    assert main(["convert", "hf-to-functrain", str(tmp / "hf"), str(tmp / "float")]) == 0
    fit(tmp, tmp / "float", steps=2, save_every=1)
    first = flatten_dict(saved_tree_metadata(tmp / "float" / "checkpoints" / "1", "params"))
    assert ("layers_0", "mlp", "up_proj", "kernel", "nf4") in first and ("lm_head", "kernel") in first
    params, meta = load_params_and_meta(tmp / "float", 2)
    converted, _ = load_params_and_meta(tmp / "converted", 0)
    assert meta["lora_base_step"] == 1
    for path, leaf in flatten_dict(converted).items():
        np.testing.assert_array_equal(flatten_dict(params)[path], leaf)


def test_a_run_that_fails_after_a_save_resumes_bitwise(qlora, monkeypatch):
    """From the same step 0, a run whose 27th train call raises (its step-25 save written) and is started again:
    the same final params as the uninterrupted run, the same losses."""
    tmp, _ = qlora
    shutil.copytree(tmp / "start", tmp / "resumed")
    fail_then_resume(monkeypatch, 27, lambda: fit(tmp, tmp / "resumed"))
    assert _digest(tmp / "resumed") == _digest(tmp / "run")
    straight = dict(_train_losses(tmp / "run"))
    assert all(loss == straight[step] for step, loss in _train_losses(tmp / "resumed"))


def test_peft_loads_the_adapters_on_the_hf_base_and_the_merged_export_is_the_model(qlora):
    """The PEFT directory on the dequantized base (the converted run's export) gives our logits; on the HF base quantized
    by bitsandbytes, the same but for the few absmax codes its CPU search rounds down; on the original float base it
    loads as any adapter. The merged export (the dequantized base plus the adapters) gives our logits."""
    tmp, _ = qlora
    run = tmp / "run"
    ours = our_logits(run, STEPS)
    assert main(["convert", "functrain-to-hf", str(run), str(tmp / "adapter")]) == 0
    assert main(["convert", "functrain-to-hf", str(tmp / "converted"), str(tmp / "base")]) == 0
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(tmp / "base")
    np.testing.assert_allclose(hf_logits(peft.PeftModel.from_pretrained(dequantized, tmp / "adapter")), ours,
                               atol=1e-5, rtol=0)
    with_adapter = peft.PeftModel.from_pretrained(bitsandbytes_base(tmp / "hf"), tmp / "adapter")
    np.testing.assert_allclose(hf_logits(with_adapter), ours, atol=5e-3, rtol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf")
    assert np.isfinite(hf_logits(peft.PeftModel.from_pretrained(original, tmp / "adapter"))).all()

    assert main(["convert", "functrain-to-hf", str(run), str(tmp / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "merged")
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-5, rtol=0)


def test_a_scanned_run_stacks_the_quantized_base_and_trains_as_the_unrolled_one(qlora):
    """From the same step 0 (the unrolled NF4 base and adapters), ``model.scan_layers``: the quantized kernels and
    the adapters stacked [layers, ...] on restore, the losses of the unrolled run."""
    tmp, _ = qlora
    shutil.copytree(tmp / "start", tmp / "scanned")
    result = functrain.fit(str(tmp / "converted" / "config.yaml"), **{
        **run_overrides(tmp, tmp / "scanned", steps=3, save_every=3), "model.scan_layers": True})
    up_proj = result.state.params["layers_stack"]["slot_0"]["mlp"]["up_proj"]
    assert {key: (value.shape, str(value.dtype)) for key, value in up_proj["kernel"].items()} == {
        "nf4": ((1, 128, 32), "uint8"), "absmax_codes": ((1, 128, 1), "uint8"), "absmax_scale": ((1, 1), "float32"),
        "absmax_offset": ((1,), "float32")}
    assert up_proj["lora_a"].shape == (1, 64, 8)
    scanned, unrolled = dict(_train_losses(tmp / "scanned")), dict(_train_losses(tmp / "run"))
    np.testing.assert_allclose([scanned[step] for step in (1, 2, 3)], [unrolled[step] for step in (1, 2, 3)],
                               atol=1e-5, rtol=0)


def test_plan_reports_the_quantized_base_and_the_state_the_run_holds(qlora):
    """``functrain plan`` of the module's run: its params are the bytes the trained run holds, the quantized base's
    share of them named (in the printed lines too); AdamW's moments are the adapters' alone; a quantized weight
    counts as its in x out weights (the HF model's count, plus the adapters)."""
    tmp, _ = qlora
    planned = plan(resolve_config(str(tmp / "converted" / "config.yaml"), run_overrides(tmp, tmp / "planned")))
    flat = flatten_dict(load_params_and_meta(tmp / "run", STEPS)[0])
    base = sum(leaf.nbytes for path, leaf in flat.items() if "kernel" in path[:-1])
    adapters = sum(leaf.nbytes for path, leaf in flat.items() if path[-1] in ("lora_a", "lora_b"))
    assert planned.quantized_base_bytes == base == QUANTIZED_BASE_BYTES
    assert planned.per_chip_bytes["params"] == sum(leaf.nbytes for leaf in flat.values())
    assert 2 * adapters <= planned.per_chip_bytes["optimizer"] <= 2 * adapters + 64  # and AdamW's step count
    hf_weights = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").num_parameters()
    assert planned.parameters == hf_weights + adapters // 4
    line = f"{'params':<12}{human_bytes(planned.per_chip_bytes['params']):>12}  (quantized base {human_bytes(base)})"
    assert line in format_plan(planned)


INT8 = dict(LORA, base_dtype="int8")
INT8_STEPS = 4


@pytest.fixture(scope="module")
def int8_run(qlora):
    """The module's HF model converted into an int8 base (``int8``, a clean copy in ``int8_start``) and trained
    ``INT8_STEPS`` steps there, saving every 2."""
    tmp, _ = qlora
    assert main(["convert", "hf-to-functrain", str(tmp / "hf"), str(tmp / "int8"), "--base-dtype", "int8"]) == 0
    shutil.copytree(tmp / "int8", tmp / "int8_start")
    fit(tmp, tmp / "int8", steps=INT8_STEPS, save_every=2, lora=INT8, converted="int8")
    return tmp


def test_an_int8_base_is_qwix_s_saved_once_and_trains_its_adapters(int8_run):
    tmp = int8_run
    base, meta = load_params_and_meta(tmp / "int8", 0)
    assert meta["model"]["lora"]["base_dtype"] == "int8"
    weight = transformers.AutoModelForCausalLM.from_pretrained(tmp / "hf").model.layers[0].mlp.down_proj.weight
    expected = quantize_int8(weight.detach().numpy())
    down_proj = base["layers_0"]["mlp"]["down_proj"]["kernel"]
    assert {key: (value.shape, str(value.dtype)) for key, value in down_proj.items()} == {
        "int8": ((64, 128), "int8"), "scale": ((64, 1), "float32")}
    np.testing.assert_array_equal(down_proj["int8"], expected["int8"])
    np.testing.assert_array_equal(down_proj["scale"], expected["scale"])
    trained, meta = load_params_and_meta(tmp / "int8", INT8_STEPS)
    assert meta["lora_base_step"] == 0
    saved = flatten_dict(saved_tree_metadata(tmp / "int8" / "checkpoints" / str(INT8_STEPS), "params"))
    assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)
    base, trained = flatten_dict(base), flatten_dict(trained)
    assert all(np.array_equal(trained[path], leaf) for path, leaf in base.items())
    assert all(np.any(leaf != 0) for path, leaf in trained.items() if path[-1] == "lora_b")


def test_an_int8_run_that_fails_after_a_save_resumes_bitwise(int8_run, monkeypatch):
    tmp = int8_run
    shutil.copytree(tmp / "int8_start", tmp / "int8_resumed")
    fail_then_resume(monkeypatch, 4, lambda: fit(tmp, tmp / "int8_resumed", steps=INT8_STEPS, save_every=2,
                                                 lora=INT8, converted="int8"))
    assert _digest(tmp / "int8_resumed") == _digest(tmp / "int8")
    straight, resumed = dict(_train_losses(tmp / "int8")), _train_losses(tmp / "int8_resumed")
    assert len(straight) == INT8_STEPS and all(loss == straight[step] for step, loss in resumed)


def test_an_int8_run_exports_a_peft_directory_and_a_merged_model(int8_run):
    """peft loads the adapters on the dequantized int8 base (``--step 0`` of the run: its base alone) and gives our
    logits; so does the merged export."""
    tmp = int8_run
    ours = our_logits(tmp / "int8", INT8_STEPS)
    assert main(["convert", "functrain-to-hf", str(tmp / "int8"), str(tmp / "int8_adapter")]) == 0
    assert main(["convert", "functrain-to-hf", str(tmp / "int8"), str(tmp / "int8_base"), "--step", "0"]) == 0
    dequantized = transformers.AutoModelForCausalLM.from_pretrained(tmp / "int8_base")
    np.testing.assert_allclose(hf_logits(peft.PeftModel.from_pretrained(dequantized, tmp / "int8_adapter")), ours,
                               atol=1e-5, rtol=0)
    assert main(["convert", "functrain-to-hf", str(tmp / "int8"), str(tmp / "int8_merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp / "int8_merged")
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-5, rtol=0)


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
