"""LoRA: exact trainable parameter count, frozen base weights, merged and PEFT exports equal to the adapter
model, bitwise kill/resume, and one-line errors for bad targets."""

import json
import shutil
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from flax.traverse_util import flatten_dict
from safetensors.numpy import load_file

import functrain
from functrain.checkpoint import load_params_and_meta
from functrain.checkpoint.layout import dir_size
from functrain.checkpoint.reader import saved_tree_metadata
from functrain.commands.cli import main
from functrain.errors import CheckpointError, ConfigError
from functrain.models.lora import LoraConfig, adapter_interceptor, lora_program
from functrain.models import llama
from functrain.models.stacking import unstack_layers
from functrain.core.step import trainable_only
from tests.conftest import REPO_ROOT, cli_env
from tests.torch_bridge.hf.test_hf_finetune import IDS, QUIET, tiny_llama_dir
from tests.run.test_resume_bitwise import DRIVER, _digest, _train_losses

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.1, "targets": ["q_proj", "v_proj", "layers_1/mlp/*"]}


def test_trainable_parameter_count_is_exact():
    config = llama.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
    rank, batch = 3, {"tokens": np.zeros((2, 9), np.int32), "weight": np.ones(2, np.float32)}
    program = lora_program(llama.build(config), batch, "causal_lm", LoraConfig(rank=rank, targets=("q_proj", "v_proj")))
    # Shapes only: init and the optimizer's init traced, not run op by op (each eager op compiled a program).
    params, _ = jax.eval_shape(program.init, jax.random.PRNGKey(0))
    mask = program.trainable(params)
    trainable = sum(leaf.size for leaf, m in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if m)
    per_layer = (32 * rank + rank * 4 * 8) + (32 * rank + rank * 2 * 8)  # q: 4 heads x 8, v: 2 kv heads x 8
    assert trainable == 2 * per_layer
    opt_state = jax.eval_shape(trainable_only(optax.adamw(1e-3), mask).init, params)
    assert sum(leaf.size for leaf in jax.tree.leaves(opt_state)) == 2 * trainable + 1  # mu, nu and the count


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A converted tiny Llama fine-tuned 3 steps with LoRA (checkpoints at 0 and 3)."""
    tmp = tmp_path_factory.mktemp("lora")
    tiny_llama_dir(tmp / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp / "hf"), str(tmp / "run")]) == 0
    result = functrain.fit(str(tmp / "run" / "config.yaml"), **QUIET, **{
        "train.max_steps": 3, "optimizer.learning_rate": 3e-2, "model.lora": LORA})
    assert result.step == 3
    return tmp


@pytest.fixture(scope="module")
def lora_run_logits(lora_run):
    """Logits of the functrain model with its adapters, from lora_run's step 3 (the tests only read them)."""
    params, meta = load_params_and_meta(lora_run / "run", 3)
    config = llama.LlamaConfig(**meta["model"])
    with jax.default_matmul_precision("highest"), nn.intercept_methods(
            adapter_interceptor(config.lora, False, jax.random.PRNGKey(0))):
        # Compiled whole: applied op by op, each op compiled a program of its own.
        return np.asarray(jax.jit(llama.build(config).apply)({"params": params}, IDS))


def test_base_weights_stay_bit_identical_and_adapters_train(lora_run):
    base, _ = load_params_and_meta(lora_run / "run", 0)
    trained, _ = load_params_and_meta(lora_run / "run", 3)
    base, trained = flatten_dict(base), flatten_dict(trained)
    for path, leaf in base.items():
        assert np.array_equal(trained[path], leaf), path
    adapters = {path: leaf for path, leaf in trained.items() if path not in base}
    assert len(adapters) == 2 * (2 * 2 + 3)  # q, v on both layers and the 3 MLP projections of layer 1
    assert all(np.any(leaf != 0) for path, leaf in adapters.items() if path[-1] == "lora_b")


def test_later_checkpoints_hold_the_adapters_only_and_the_base_step_is_kept(lora_run):
    """Steps after the converted base hold the adapter leaves only (a small fraction of the bytes), restore to the
    run's full params, and rotation with keep=1 never deletes the base step they name."""
    run = lora_run / "keep1"
    shutil.copytree(lora_run / "run" / "checkpoints" / "0", run / "checkpoints" / "0")
    result = functrain.fit(str(lora_run / "run" / "config.yaml"), **QUIET, **{
        "run.dir": str(run), "train.max_steps": 6, "checkpoint.every_steps": 2, "checkpoint.keep": 1,
        "model.lora": {"rank": 1, "targets": ["q_proj"]}})
    steps = run / "checkpoints"
    assert sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) == [0, 6]
    saved = flatten_dict(saved_tree_metadata(steps / "6", "params"))
    assert saved and all(path[-1] in ("lora_a", "lora_b") for path in saved)
    # The adapters are 0.3% of the values; Orbax's metadata files (a few KB per item) make up the rest.
    assert dir_size(steps / "6" / "params") < 0.15 * dir_size(steps / "0" / "params")
    params, meta = load_params_and_meta(run, 6)
    assert meta["lora_base_step"] == 0
    expected = flatten_dict(jax.device_get(result.state.params))
    assert sorted(flatten_dict(params)) == sorted(expected)
    assert all(np.array_equal(leaf, expected[path]) for path, leaf in flatten_dict(params).items())


def test_a_fresh_lora_run_saves_full_params_first_then_adapters_only(lora_run):
    """Without a converted base the run's first save holds full params and is the base step of the later ones."""
    run = lora_run / "fresh"
    result = functrain.fit(str(lora_run / "run" / "config.yaml"), **QUIET, **{
        "run.dir": str(run), "checkpoint.resume": "never", "train.max_steps": 3, "checkpoint.every_steps": 1,
        "checkpoint.keep": 1, "model.lora": LORA})
    steps = run / "checkpoints"
    assert sorted(int(p.name) for p in steps.iterdir() if p.name.isdigit()) == [1, 3]
    assert any(path[-1] == "kernel" for path in flatten_dict(saved_tree_metadata(steps / "1", "params")))
    params, meta = load_params_and_meta(run)
    assert meta["step"] == 3 and meta["lora_base_step"] == 1
    expected = flatten_dict(jax.device_get(result.state.params))
    assert all(np.array_equal(leaf, expected[path]) for path, leaf in flatten_dict(params).items())
    assert sorted(flatten_dict(params)) == sorted(expected)


def test_an_adapters_only_step_with_a_replaced_or_damaged_base_names_its_base_step(lora_run):
    run = lora_run / "damaged_base"
    shutil.copytree(lora_run / "run", run)
    meta_file = run / "checkpoints" / "0" / "meta" / "metadata"
    assert json.loads((run / "checkpoints" / "3" / "meta" / "metadata").read_text())["lora_base_step"] == 0
    base_meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**base_meta, "time": base_meta["time"] + 1}))  # step 0 written again
    with pytest.raises(CheckpointError, match=r"step 3 .*LoRA base step 0 .*written again"):
        load_params_and_meta(run, 3)
    meta_file.write_text(json.dumps(base_meta))
    shutil.rmtree(run / "checkpoints" / "0" / "params" / "ocdbt.process_0")
    with pytest.raises(CheckpointError, match=r"step 3 .*LoRA base step 0 is damaged"):
        load_params_and_meta(run, 3)


def test_merged_export_and_peft_adapter_give_the_adapter_models_logits(lora_run, lora_run_logits, capsys):
    expected = lora_run_logits
    assert main(["convert", "functrain-to-hf", str(lora_run / "run"), str(lora_run / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(lora_run / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged), expected, atol=1e-5, rtol=0)

    assert main(["convert", "functrain-to-hf", str(lora_run / "run"), str(lora_run / "adapter")]) == 0
    adapter_config = json.loads((lora_run / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8.0
    base = transformers.AutoModelForCausalLM.from_pretrained(lora_run / "hf").eval()
    with_adapter = peft.PeftModel.from_pretrained(base, lora_run / "adapter").eval()
    np.testing.assert_allclose(hf_logits(with_adapter), expected, atol=1e-5, rtol=0)
    assert np.abs(expected - hf_logits(transformers.AutoModelForCausalLM.from_pretrained(lora_run / "hf"))).max() > 1e-3


def test_generate_decodes_with_the_adapters(lora_run, lora_run_logits):
    from functrain.text.decode import load_language_model
    model, params, step = load_language_model(lora_run / "run")
    assert step == 3 and "lora_a" not in str(jax.tree_util.tree_structure(params))
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(np.asarray(jax.jit(model.apply)({"params": params}, IDS)), lora_run_logits,
                                   atol=1e-5, rtol=0)


def test_lora_run_killed_and_resumed_is_bitwise_identical(lora_run):
    """From the converted base (fresh adapters), one run straight through, one SIGKILLed after dispatching its
    3rd step and resumed: same params digest and losses (the killed attempt runs in a subprocess)."""
    # lora_run's shapes and adapters (dropout on): its compiled train step is this run's (a compilation cache hit).
    overrides = ["train.max_steps=4", "train.steps_per_call=1", "checkpoint.every_steps=2", "log.every_steps=1",
                 "log.progress=false", f"data.seq_len={QUIET['data.seq_len']}",
                 f"data.global_batch_size={QUIET['data.global_batch_size']}", "data.eval_fraction=0",
                 f"model.lora={json.dumps(LORA)}"]
    runs = {}
    for name in ("straight", "killed"):
        runs[name] = lora_run / name
        shutil.copytree(lora_run / "run" / "checkpoints" / "0", runs[name] / "checkpoints" / "0")
    config = str(lora_run / "run" / "config.yaml")
    assert main(["train", config, f"run.dir={runs['straight']}", *overrides]) == 0
    killed = subprocess.run([sys.executable, "-c", DRIVER, "train", config, f"run.dir={runs['killed']}", *overrides],
                            cwd=REPO_ROOT, env=cli_env(FT_KILL="call:3"), capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed_from = json.loads((runs["killed"] / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert resumed_from["lora_base_step"] == 0  # an adapters-only step
    assert main(["train", config, f"run.dir={runs['killed']}", *overrides]) == 0
    assert _digest(runs["killed"]) == _digest(runs["straight"])
    straight = dict(_train_losses(runs["straight"]))
    assert sorted(straight) == [1, 2, 3, 4]
    assert all(loss == straight[step] for step, loss in _train_losses(runs["killed"]))


SCANNED = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj", "*/mlp/*"]}


def fit_layers(lora_run, name, scan):
    """3 steps of ``SCANNED`` adapters in ``lora_run / name`` (from the step 0 it holds), layers scanned or not."""
    return functrain.fit(str(lora_run / "run" / "config.yaml"), **QUIET, **{
        "run.dir": str(lora_run / name), "train.max_steps": 3, "checkpoint.every_steps": 1,
        "optimizer.learning_rate": 3e-2, "model.lora": SCANNED, "model.scan_layers": scan})


@pytest.fixture(scope="module")
def scan_pair(lora_run):
    """From the converted base, the same adapters trained 3 steps with the layers unrolled and scanned."""
    for name, scan in (("unrolled", False), ("scanned", True)):
        shutil.copytree(lora_run / "run" / "checkpoints" / "0", lora_run / name / "checkpoints" / "0")
        fit_layers(lora_run, name, scan)
    return lora_run


def test_scanned_lora_trains_as_unrolled_lora_with_its_adapters_stacked(scan_pair):
    """The same losses and weights (the fresh adapters too: drawn per layer as unrolled); the scanned run saves its
    adapters stacked [layers, ...] onto the unrolled converted base, and its steps read back scanned."""
    unrolled, scanned = (dict(_train_losses(scan_pair / name)) for name in ("unrolled", "scanned"))
    assert sorted(scanned) == [1, 2, 3] and scanned[3] < scanned[1] - 0.1
    np.testing.assert_allclose([scanned[step] for step in (1, 2, 3)], [unrolled[step] for step in (1, 2, 3)],
                               atol=1e-5, rtol=0)
    saved = flatten_dict(saved_tree_metadata(scan_pair / "scanned" / "checkpoints" / "3", "params"))
    assert {path[:2] for path in saved} == {("layers_stack", "slot_0")} and len(saved) == 2 * 5
    assert saved[("layers_stack", "slot_0", "mlp", "up_proj", "lora_a")].shape == (2, 32, 4)
    expected = flatten_dict(load_params_and_meta(scan_pair / "unrolled", 3)[0])
    scanned_params = load_params_and_meta(scan_pair / "scanned", 3)[0]
    assert sorted(scanned_params) == ["embed_tokens", "layers_stack", "lm_head", "norm"]  # read in its own layout
    got = flatten_dict(unstack_layers(scanned_params))
    assert sorted(got) == sorted(expected)
    for path, leaf in expected.items():
        np.testing.assert_allclose(got[path], leaf, atol=1e-5, rtol=0, err_msg=str(path))


def test_a_scanned_lora_run_resumes_bitwise_and_in_the_unrolled_layout(scan_pair):
    """From the scanned run's step 2: resumed scanned, bitwise its step 3; resumed unrolled (the stacked adapters
    and their AdamW moments unstacked on load), its step 3 within float tolerance."""
    for name in ("scanned_resumed", "to_unrolled"):
        shutil.copytree(scan_pair / "scanned" / "checkpoints", scan_pair / name / "checkpoints")
        shutil.rmtree(scan_pair / name / "checkpoints" / "3")
    fit_layers(scan_pair, "scanned_resumed", True)
    assert _digest(scan_pair / "scanned_resumed") == _digest(scan_pair / "scanned")
    straight = dict(_train_losses(scan_pair / "scanned"))
    assert _train_losses(scan_pair / "scanned_resumed") == [(3, straight[3])]
    fit_layers(scan_pair, "to_unrolled", False)
    [(step, loss)] = _train_losses(scan_pair / "to_unrolled")
    assert step == 3 and abs(loss - straight[3]) < 1e-5
    expected = flatten_dict(unstack_layers(load_params_and_meta(scan_pair / "scanned", 3)[0]))
    for path, leaf in flatten_dict(load_params_and_meta(scan_pair / "to_unrolled", 3)[0]).items():
        np.testing.assert_allclose(leaf, expected[path], atol=1e-5, rtol=0, err_msg=str(path))


def test_a_scanned_run_exports_the_unrolled_run_s_peft_directory_and_merged_model(scan_pair):
    """Unstacked: the PEFT directory has the same config and tensors, the merged model the same logits."""
    exported = {}
    for name in ("unrolled", "scanned"):
        out = scan_pair / f"{name}_export"
        assert main(["convert", "functrain-to-hf", str(scan_pair / name), str(out / "adapter")]) == 0
        assert main(["convert", "functrain-to-hf", str(scan_pair / name), str(out / "merged"), "--merge-lora"]) == 0
        exported[name] = (json.loads((out / "adapter" / "adapter_config.json").read_text()),
                          load_file(out / "adapter" / "adapter_model.safetensors"),
                          hf_logits(transformers.AutoModelForCausalLM.from_pretrained(out / "merged").eval()))
    (config, tensors, logits), (scanned_config, scanned_tensors, scanned_logits) = exported.values()
    assert scanned_config == config and sorted(scanned_tensors) == sorted(tensors) and len(tensors) == 2 * 10
    for name, tensor in tensors.items():
        np.testing.assert_allclose(scanned_tensors[name], tensor, atol=1e-5, rtol=0, err_msg=name)
    np.testing.assert_allclose(scanned_logits, logits, atol=1e-5, rtol=0)


def test_a_target_matching_nothing_is_one_line_exit_2(lora_run, capsys):
    before = sorted(p.name for p in (lora_run / "run" / "checkpoints").iterdir())
    status = main(["train", str(lora_run / "run" / "config.yaml"), "model.lora={rank: 2, targets: [q_proj, qkv]}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "'qkv' matches no projection" in err, err
    assert sorted(p.name for p in (lora_run / "run" / "checkpoints").iterdir()) == before


def test_merge_lora_without_adapters_is_an_error(tmp_path, capsys):
    tiny_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert main(["convert", "functrain-to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--merge-lora"]) == 2
    assert "has no LoRA adapters" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="rank"):
        LoraConfig(rank=0)
    with pytest.raises(ConfigError, match="'nothing' matches no projection"):
        lora_program(llama.build(llama.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                                   num_hidden_layers=1, num_attention_heads=2)),
                     {"tokens": np.zeros((1, 3), np.int32), "weight": np.ones(1)}, "causal_lm",
                     LoraConfig(targets=("nothing",)))


def test_finetune_lora_example_matches_the_tiny_model_its_header_builds():
    from functrain.config.load import load_config
    from functrain.models import qwen2
    config = load_config("configs/finetune_lora.yaml")
    hf = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  tie_word_embeddings=True)
    assert config.model == qwen2.from_hf_config(hf.to_dict()).model_copy(update={"lora": config.model.lora})
    assert config.model.lora.targets[0] == "q_proj"


def test_adapters_on_a_fused_hf_projection_need_merge_lora():
    from functrain.errors import CheckpointError
    from functrain.models import phi3
    from torch_bridge.hf.architectures import architectures
    from torch_bridge.hf.peft_adapter import hf_modules
    config = phi3.Phi3Config(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=2)
    assert hf_modules(architectures()["phi3"], config, [("layers_0", "self_attn", "o_proj")]) == {
        ("layers_0", "self_attn", "o_proj"): "model.layers.0.self_attn.o_proj"}
    with pytest.raises(CheckpointError, match="layers_0/self_attn/q_proj have no PEFT form for phi3.*--merge-lora"):
        hf_modules(architectures()["phi3"], config, [("layers_0", "self_attn", "q_proj")])
