"""``model.scan_layers``: scanned models train as the unrolled ones do (Llama with GQA on packed documents, Gemma 3
with alternating windows and per-layer RoPE plus an unrolled remainder; GPT through ``fit``), their stacked
params export to HF with transformers' logits, checkpoints restore across the two layouts and resume bit for bit
scanned, sampling reads a scanned run, and models that do not scan are refused in one line."""

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import transformers

import functrain
from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest
from functrain.commands.cli import main
from functrain.models import build_model, model_config_class
from functrain.models.stacking import is_stacked, relayout_like, unstack_layers
from functrain.text.decode import Generator, Sampling, load_language_model
from tests.torch_bridge.hf.test_hf_convert import IDS, hf_logits
from tests.torch_bridge.hf.test_hf_families import build_family_model, highest_precision  # noqa: F401 (a fixture)
from torch_bridge.hf import load_pretrained, save_pretrained

TOKENS = np.random.default_rng(0).integers(0, 64, (2, 16))
SEGMENTS = np.array([[1] * 9 + [2] * 7, [1] * 16], np.int32)  # two packed documents in the first row
POSITIONS = np.array([list(range(9)) + list(range(7)), list(range(16))], np.int32)
FAMILIES = {
    "llama": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, remat="full"),
    # Period 2 (local, global): one scanned group and one unrolled layer; sliding layers use the local theta.
    "gemma3_text": dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                        rope_local_base_freq=100.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}


def _both_layouts(name: str) -> tuple[nn.Module, nn.Module]:
    config = model_config_class(name).model_validate({"name": name, **FAMILIES[name]})
    return build_model(config), build_model(config.model_copy(update={"scan_layers": True}))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_scanned_models_train_as_the_unrolled_ones(name):
    unrolled, scanned = _both_layouts(name)
    boxed = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), TOKENS)["params"]
    boxes = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    stacked_boxes = [box for box in boxes if "layers" in box.names]
    assert is_stacked(boxed) and stacked_boxes and all(box.names[0] == "layers" for box in stacked_boxes)
    params = jax.jit(lambda: nn.meta.unbox(unrolled.init(jax.random.PRNGKey(0), TOKENS)["params"]))()
    stacked = relayout_like(params, nn.meta.unbox(boxed))

    @jax.jit  # one compile for both layouts
    def two_steps(params, stacked):
        def loss(model, p):
            logits = model.apply({"params": p}, TOKENS[:, :-1], segment_ids=SEGMENTS[:, :-1],
                                 positions=POSITIONS[:, :-1])
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, TOKENS[:, 1:])
            return jnp.mean(jnp.where(SEGMENTS[:, 1:] == SEGMENTS[:, :-1], nll, 0.0))

        def train(model, p):
            def sgd_step(p, _):
                value, grads = jax.value_and_grad(lambda q: loss(model, q))(p)
                return jax.tree.map(lambda leaf, grad: leaf - 2.0 * grad, p, grads), value
            p, losses = jax.lax.scan(sgd_step, p, None, length=3)  # the step compiles once
            return losses, p
        return train(unrolled, params), train(scanned, stacked)

    (losses, trained), (scanned_losses, scanned_trained) = two_steps(params, stacked)
    assert losses[2] < losses[0] - 1e-3  # the steps move the model: the comparison means something
    np.testing.assert_allclose(scanned_losses, losses, atol=1e-5, rtol=0)
    flat = dict(jax.tree_util.tree_flatten_with_path(unstack_layers(scanned_trained))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(trained)[0]:
        np.testing.assert_allclose(flat[path], leaf, atol=1e-5, rtol=0)


def test_stacks_hold_layer_g_times_period_plus_j_and_unstack_back():
    """Seven layers with a period of three: two groups of three stacked, layer 6 unrolled (pure tree code)."""
    layers = {f"layers_{i}": {"mlp": {"kernel": np.full((2, 3), float(i))}} for i in range(7)}
    like = {"layers_stack": {f"slot_{j}": {"mlp": {"kernel": jax.ShapeDtypeStruct((2, 2, 3), np.float32)}}
                             for j in range(3)},
            "layers_6": {"mlp": {"kernel": jax.ShapeDtypeStruct((2, 3), np.float32)}}}
    stacked = relayout_like({"norm": np.ones(3), **layers}, {"norm": jax.ShapeDtypeStruct((3,), np.float32), **like})
    assert [stacked["layers_stack"]["slot_1"]["mlp"]["kernel"][g, 0, 0] for g in range(2)] == [1.0, 4.0]
    assert stacked["layers_6"]["mlp"]["kernel"][0, 0] == 6.0 and is_stacked(stacked)
    back = unstack_layers(stacked)
    assert sorted(back) == sorted(["norm", *layers])
    assert all((back[name]["mlp"]["kernel"] == layers[name]["mlp"]["kernel"]).all() for name in layers)


def test_scanned_params_export_to_hf_with_transformers_logits(tmp_path, highest_precision):  # noqa: F811
    reference_model = build_family_model("gemma2_softcap_alternating")
    reference = hf_logits(reference_model)
    reference_model.save_pretrained(tmp_path / "in")
    _, params, config = load_pretrained(tmp_path / "in")
    scanned = build_model(config.model_copy(update={"scan_layers": True}))
    stacked = relayout_like(params, nn.meta.unbox(jax.eval_shape(scanned.init, jax.random.PRNGKey(0), IDS)["params"]))
    assert is_stacked(stacked)
    np.testing.assert_allclose(np.asarray(scanned.apply({"params": stacked}, IDS)), reference, atol=1e-5, rtol=0)
    out = save_pretrained(stacked, config.model_copy(update={"scan_layers": True}), tmp_path / "out")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_logits(exported), reference, atol=1e-5, rtol=0)


RUN = {
    "model": {"name": "gpt", "vocab_size": 256, "max_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2,
              "d_ff": 64, "remat": "full", "scan_layers": True},
    "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 4, "eval_fraction": 0.0},
    "optimizer": {"name": "adamw", "learning_rate": 0.01, "warmup_steps": 0},
    "train": {"max_steps": 4, "steps_per_call": 2},
    "checkpoint": {"every_steps": 2, "async_save": False},
    "log": {"every_steps": 2, "progress": False, "tensorboard": False},
}


def _losses(run_dir) -> dict[int, float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if line["split"] == "train"}


def _halfway(whole, to):
    """``whole`` as it was at step 2 (its checkpoint then): a fresh fit resumes it."""
    shutil.copytree(whole, to)
    shutil.rmtree(to / "checkpoints" / "4")
    return to


def test_a_scanned_run_resumes_bitwise_restores_unrolled_and_samples(tmp_path, compilation_cache):
    """GPT trained scanned: resumed scanned it ends bit-identical; its stacked checkpoint (params and Adam's
    moments) resumed unrolled trains on the same numbers, and back; ``generate`` reads it. The compilation
    cache compiles each layout's train call once."""
    whole = tmp_path / "whole"
    functrain.fit(RUN, **{"run.dir": str(whole)})
    saved = load_params(whole, 4)
    assert is_stacked(saved) and saved["block_stack"]["slot_0"]["mlp_in"]["kernel"].shape == (2, 32, 64)
    resumed = _halfway(whole, tmp_path / "resumed")
    functrain.fit(RUN, **{"run.dir": str(resumed)})
    assert params_digest(load_params(resumed, 4)) == params_digest(saved)
    assert _losses(resumed) == _losses(whole)

    unrolled = _halfway(whole, tmp_path / "unrolled")
    functrain.fit(RUN, **{"run.dir": str(unrolled), "model.scan_layers": False})
    params = load_params(unrolled, 4)
    assert not is_stacked(params)
    np.testing.assert_allclose(_losses(unrolled)[4], _losses(whole)[4], atol=1e-5, rtol=0)
    flat = dict(jax.tree_util.tree_flatten_with_path(unstack_layers(saved))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        np.testing.assert_allclose(leaf, flat[path], atol=1e-5, rtol=0)
    # And back: the unrolled step-4 checkpoint resumed scanned for two more steps.
    functrain.fit(RUN, **{"run.dir": str(unrolled), "train.max_steps": 6})
    assert is_stacked(load_params(unrolled, 6)) and np.isfinite(_losses(unrolled)[6])

    model, params, step = load_language_model(whole)
    assert step == 4 and not model.config.scan_layers and not is_stacked(params)
    assert Generator(model)(params, np.array([[5, 17, 42]]), Sampling(4)).shape == (1, 4)


@pytest.mark.parametrize("model, backend, named", [
    ({"name": "mlp"}, "jax", "not supported by model mlp"),
    ({"name": "gpt2"}, "jax", "not supported by model gpt2"),
    ({"target": "mypackage.models:make"}, "jax", "not supported by model target"),
    ({"name": "llama", "num_hidden_layers": 2, "lora": {"targets": ["layers_1/*"]}}, "jax",
     "'layers_1/*' matches 1 of the 2 scanned layers of layers_stack/slot_0/mlp/down_proj"),
    ({"name": "gpt"}, "torch", "not implemented by the torch gpt twin"),
])
def test_models_that_do_not_scan_are_refused_in_one_line(tmp_path, capsys, model, backend, named):
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps({"backend": backend, "model": {**model, "scan_layers": True},
                                  "data": {"name": "char_text"}, "train": {"max_steps": 1},
                                  "run": {"dir": str(tmp_path / "run")}}))
    code = main(["train", str(config)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
