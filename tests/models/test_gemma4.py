"""Gemma 4 in functrain's own paths, beside its conversion cases (tests/torch_bridge/hf/test_hf_families.py) and the
checks it shares with the other recent families (tests/models/test_recent_families.py: cached generation against
transformers', scanned layers): decoding with the cache computes the full forward past the window (each layer type's
cache its own width), also with layers sharing keys and values, whose scan computes the unrolled layers' logits; LoRA adapters on its projections export merged and as a PEFT adapter that transformers runs;
a run with per-layer inputs cut after a checkpoint resumes bitwise; its config reads as transformers derives it."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import transformers
from flax.traverse_util import flatten_dict, unflatten_dict

import functrain
from functrain.checkpoint import layout, load_params
from functrain.checkpoint.digest import params_digest
from functrain.core.model_output import logits_of
from functrain.models import build_model
from functrain.models.configs.gemma4 import Gemma4TextConfig
from functrain.models.configs.lora import LoraConfig
from functrain.models.gemma4 import from_hf_config
from functrain.models.lora import adapter_interceptor, add_adapters, merged_params, target_paths
from functrain.models.stacking import relayout_like
from tests.commands.test_verify_resume import killed_after_a_save
from tests.models.test_attention import random_params
from tests.models.test_deepseek_v3 import cache_shapes, decoded_and_full_logits
from tests.models.test_recent_families import SCANNED
from tests.models.test_scan_layers import RUN, _losses
from tests.torch_bridge.hf.test_hf_convert import hf_logits
from tests.torch_bridge.hf.test_hf_families import build_family_model
from torch_bridge.hf import load_pretrained, save_pretrained
from torch_bridge.hf.architectures import architecture_for
from torch_bridge.hf.peft_adapter import write_adapter_dir

TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 10)))


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(transformers model, its directory, functrain params, config) of the every-feature case."""
    hf_model = build_family_model("gemma4_every_feature", num_hidden_layers=2,
                                  layer_types=["sliding_attention", "full_attention"])  # the cheaper compile
    directory = tmp_path_factory.mktemp("gemma4")
    hf_model.save_pretrained(directory)
    _, params, config = load_pretrained(directory)
    return hf_model, directory, params, config.model_copy(update={"moe_dispatch": "dense"})  # the cheaper compile


def test_decoding_with_the_cache_computes_the_full_forward(converted, highest_precision):
    _, _, params, config = converted
    model = build_model(config)
    shapes = cache_shapes(model, params, TOKENS)
    keys = [shapes[f"layers_{i}"]["self_attn"]["cached_key"].shape for i in range(2)]
    assert keys == [(2, 2, 8, 10), (2, 1, 16, 10)]  # [B, KV, D, S]: a sliding layer's, a global one's
    spans = ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10))  # a prompt, then one token at a time past the window 4
    decoded, full = decoded_and_full_logits(model, params, TOKENS, spans)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=0)


def test_layers_sharing_keys_and_values_decode_and_scan_as_the_full_forward(highest_precision):
    """6 layers, the last 2 reusing layer 2's (sliding) and layer 3's (global) keys and values: decoding with the
    cache (the sharing layers keep none of their own) computes the full forward past the window, and the layers
    scanned (the first pair as a group, layers 2-3 one by one to hand their keys and values on, the sharing pair as
    a group of its own) compute the unrolled layers' logits."""
    config = Gemma4TextConfig(**{**SCANNED["gemma4"], "num_hidden_layers": 6, "num_kv_shared_layers": 2,
                                 "use_double_wide_mlp": True, "layer_types": ["sliding_attention", "full_attention"] * 3})
    tokens = TOKENS % config.vocab_size
    model = build_model(config)
    params = random_params(model, tokens)
    assert set(cache_shapes(model, params, tokens)["kv_shared_layers_0"]["self_attn"]) == {"cache_index"}
    spans = ((0, 5), (5, 6), (6, 7), (7, 8), (8, 9), (9, 10))  # a prompt, then one token at a time past the window 3
    decoded, full = decoded_and_full_logits(model, params, tokens, spans)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=0)

    scanned = build_model(config.model_copy(update={"scan_layers": True}))
    boxed = nn.meta.unbox(jax.eval_shape(scanned.init, jax.random.PRNGKey(0), tokens)["params"])
    assert {name for name in boxed if not name.startswith(("embed", "per_layer", "norm"))} == {
        "layers_stack", "layers_2", "layers_3", "kv_shared_layers_stack"}
    stacked = relayout_like(jax.tree.map(np.asarray, params), boxed)  # by numpy: JAX compiles each stacking op
    np.testing.assert_allclose(logits_of(jax.jit(scanned.apply)({"params": stacked}, tokens)), full, atol=1e-5, rtol=0)


def test_lora_adapters_export_merged_and_as_a_peft_adapter(converted, tmp_path, highest_precision):
    hf_model, directory, params, config = converted
    settings = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "per_layer_input_gate"))
    paths = target_paths(params, settings.targets)
    assert [path for path in paths if path[-1] == "v_proj"] == [("layers_0", "self_attn", "v_proj")]  # keys as values
    adapted = dict(flatten_dict(add_adapters(params, paths, settings.rank, jax.random.PRNGKey(0))))
    for index, path in enumerate(path for path in adapted if path[-1] == "lora_b"):  # trained adapters
        adapted[path] = 0.2 * jax.random.normal(jax.random.PRNGKey(index), adapted[path].shape)
    adapted = unflatten_dict(adapted)

    @jax.jit  # one program: run eagerly, the forward compiled each of its ops (about 280 programs)
    def adapted_logits(adapted):
        with nn.intercept_methods(adapter_interceptor(settings, False, jax.random.PRNGKey(0))):
            return logits_of(build_model(config).apply({"params": adapted}, TOKENS))

    expected = np.asarray(adapted_logits(adapted))
    assert np.abs(expected - hf_logits(hf_model, np.asarray(TOKENS))).max() > 1e-3  # the adapters count
    save_pretrained(merged_params(adapted, settings.scale), config, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged, np.asarray(TOKENS)), expected, atol=1e-5, rtol=0)

    hf = hf_model.config.to_dict()
    write_adapter_dir(adapted, config.model_copy(update={"lora": settings}), architecture_for(hf), tmp_path / "peft")
    base = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    np.testing.assert_allclose(hf_logits(with_adapter, np.asarray(TOKENS)), expected, atol=1e-5, rtol=0)


def test_a_run_with_per_layer_inputs_killed_after_a_checkpoint_resumes_bitwise(tmp_path, compilation_cache):
    """A scanned run of a global and a sliding layer with per-layer inputs and experts, SIGKILLed after a checkpoint
    and resumed, ends bit-identical."""
    model = {"name": "gemma4", **SCANNED["gemma4"], "vocab_size": 256, "vocab_size_per_layer_input": 256,
             "num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "enable_moe_block": True,
             "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 16, "moe_dispatch": "dense",
             "scan_layers": True}
    # RUN's 4 steps, 2 a call, a checkpoint each call: killed at step 4's call boundary (before its checkpoint), the
    # run resumes from step 2's, as it did with 6 steps, with fewer checkpoints to write.
    run = {**RUN, "model": model}
    whole = tmp_path / "whole"
    functrain.fit(run, **{"run.dir": str(whole)})
    saved = load_params(whole, 4)
    assert saved["layers_stack"]["slot_0"]["per_layer_input_gate"]["kernel"].shape == (1, 32, 8)
    resumed = killed_after_a_save(run, tmp_path / "resumed", kill_step=3)
    assert max(layout.committed_steps(layout.checkpoints_dir(resumed))) == 2  # the resumed run trains a call
    functrain.fit(run, **{"run.dir": str(resumed)})
    assert params_digest(load_params(resumed, 4)) == params_digest(saved)
    assert _losses(resumed) == _losses(whole)
    np.testing.assert_array_equal(saved["layers_stack"]["slot_0"]["layer_scalar"], [[1.0]])  # a frozen buffer


def test_gemma4_reads_its_config_as_transformers_derives_it():
    hf = dict(model_type="gemma4_text", num_hidden_layers=7, head_dim=8, global_head_dim=24, num_key_value_heads=2,
              num_global_key_value_heads=1, num_attention_heads=4, layer_types=["sliding_attention"] * 7)
    for keys_are_values in (False, True):
        theirs = transformers.Gemma4TextConfig(**hf, attention_k_eq_v=keys_are_values)
        ours = from_hf_config({**hf, "attention_k_eq_v": keys_are_values})
        assert list(ours.resolved_layer_types()) == theirs.layer_types  # the last layer forced global
        layers = theirs.per_layer_config
        assert [ours.head_dim_of(i) for i in range(7)] == [layers[i].head_dim for i in range(7)] == [8] * 6 + [24]
        assert [ours.kv_heads_of(i) for i in range(7)] == [layers[i].num_key_value_heads for i in range(7)]
        assert ours.kv_heads_of(6) == (1 if keys_are_values else 2)
    derived = from_hf_config(dict(model_type="gemma4_text", num_hidden_layers=12))
    assert [derived.attention_window(i) for i in range(12)] == ([512] * 5 + [None]) * 2
    assert derived.full_rope.proportional and derived.full_rope.partial_rotary_factor == 0.25
    # Gemma 4 E2B's sharing: 35 layers, four sliding to one global, the last 20 reusing keys and values.
    e2b = dict(model_type="gemma4_text", num_hidden_layers=35, num_kv_shared_layers=20,
               layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7)
    modes = transformers.Gemma4TextConfig(**e2b).kv_sharing_modes
    shared = from_hf_config(e2b)
    assert [i for i in range(35) if shared.kv_stored(i)] == [i for i, mode in enumerate(modes) if mode == "store"]
    assert [i for i in range(35) if shared.kv_shared(i)] == [i for i, mode in enumerate(modes) if mode == "reuse"]
    assert {shared.kv_source(i) for i in range(15, 35)} == {13, 14}

