"""SmolLM3, OLMo 3, GLM-4.5 and Llama 4 in functrain's own paths: a bf16 sharded HF directory converted, fine-tuned
with LoRA through ``fit`` and exported (merged, and as a PEFT adapter) gives transformers the trained model's logits;
cached greedy generation continues a prompt as transformers' ``generate`` does (past the sliding windows and
attention chunks); scanned, rematerialised layers train as the unrolled ones (the repeating group scanned, the rest
unrolled); Llama 4's packed documents are chunked from their own starts and a cut run resumes bitwise; and the
configs transformers derives (SmolLM3's NoPE layers, OLMo 3's old rope layout, GLM-4.5's released keys, Llama 4's
layer lists) read as transformers reads them. Logits and round trips against transformers:
tests/torch_bridge/hf/test_hf_families.py."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

import functrain
from functrain.checkpoint import layout, load_params
from functrain.checkpoint.digest import params_digest
from functrain.commands.cli import main
from functrain.core.model_output import logits_of
from functrain.models import build_model, model_config_class
from functrain.models.glm4_moe import from_hf_config as glm4_moe_config
from functrain.models.llama4 import from_hf_config as llama4_config
from functrain.models.olmo3 import from_hf_config as olmo3_config
from functrain.models.smollm3 import from_hf_config as smollm3_config
from functrain.models.stacking import relayout_like, unstack_layers
from functrain.text.decode import Generator, Sampling, load_language_model
from tests.commands.test_verify_resume import killed_after_a_save
from tests.models.test_attention import random_params
from tests.models.test_mtp import assert_round_trip, check_against_the_reference, with_mtp_layers
from tests.models.test_scan_layers import RUN, _losses
from tests.torch_bridge.hf.test_hf_convert import hf_logits
from tests.torch_bridge.hf.test_hf_families import build_family_model
from tests.torch_bridge.hf.test_hf_finetune import QUIET
from torch_bridge.hf import load_pretrained

# Each family's case with every feature on (test_hf_families.CASES).
CASES = {"smollm3": "smollm3_nope_windows_biases_yarn", "olmo3": "olmo3_rope_by_layer_type_biases",
         "glm4_moe": "glm4_moe_groups_qk_norm_partial_yarn", "llama4": "llama4_chunks_nope_temperature_experts"}
PROMPT = np.array([[5, 17, 42, 8, 3], [60, 2, 9, 33, 11]])


@pytest.fixture(scope="module")
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


# Fine-tuned with LoRA through fit: Llama 4's projections are the same Dense layers (its fit would cost the suite
# most of its tests' time).
FINETUNED = sorted(set(CASES) - {"llama4"})


@pytest.fixture(scope="module", params=FINETUNED)
def finetuned(request, tmp_path_factory):
    """(family, directory): a byte-vocabulary model saved by transformers in bf16 shards (``hf``), converted
    (``run``) and fine-tuned 2 steps with LoRA on q_proj and v_proj through ``fit``."""
    family, root = request.param, tmp_path_factory.mktemp(request.param)
    model = build_family_model(CASES[family], dtype=torch.bfloat16, vocab_size=256, max_position_embeddings=64)
    model.save_pretrained(root / "hf", max_shard_size=20000)
    assert (root / "hf" / "model.safetensors.index.json").exists()
    assert main(["convert", "hf-to-functrain", str(root / "hf"), str(root / "run")]) == 0
    lora = {"rank": 2, "alpha": 4.0, "targets": ["q_proj", "v_proj"]}
    result = functrain.fit(str(root / "run" / "config.yaml"), **{
        **QUIET, "train.max_steps": 2, "optimizer.learning_rate": 3e-2, "model.lora": lora, "data.seq_len": 16})
    assert result.step == 2
    return family, root


def test_a_lora_fine_tune_exports_merged_and_as_a_peft_adapter_with_the_trained_logits(finetuned, highest_precision):
    family, root = finetuned
    model, params, step = load_language_model(root / "run")  # the adapters merged into the base weights
    ids = PROMPT % 256
    trained = np.asarray(logits_of(jax.jit(model.apply)({"params": params}, ids)))
    assert step == 2 and model.config.name == family
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval()
    assert np.abs(hf_logits(base, ids) - trained).max() > 1e-4  # the adapters trained

    assert main(["convert", "functrain-to-hf", str(root / "run"), str(root / "merged"), "--merge-lora"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(root / "merged").eval()
    assert type(merged) is type(base)
    np.testing.assert_allclose(hf_logits(merged, ids), trained, atol=1e-5, rtol=0)
    assert main(["convert", "functrain-to-hf", str(root / "run"), str(root / "adapter")]) == 0
    with_adapter = peft.PeftModel.from_pretrained(base, root / "adapter").eval()
    np.testing.assert_allclose(hf_logits(with_adapter, ids), trained, atol=1e-5, rtol=0)


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    """(transformers model, functrain params, config) of a family's case with every feature on."""
    hf_model = build_family_model(CASES[request.param])
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    _, params, config = load_pretrained(directory)
    return hf_model, params, config


def test_cached_greedy_generation_continues_as_transformers_does(converted, highest_precision):
    hf_model, params, config = converted
    hf_model.generation_config.eos_token_id = None  # the full length, as functrain generates
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():  # 12 new tokens after 5: past every window of 4 and chunk of 3
        expected = hf_model.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False)
    got = Generator(build_model(config))(params, PROMPT, Sampling(12))
    np.testing.assert_array_equal(got, expected.numpy()[:, PROMPT.shape[1] :])


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=64)
# Layer patterns a scan groups: SmolLM3's NoPE every second layer, windowed (period 2: two groups and one layer
# unrolled), OLMo 3's sliding/full alternation (likewise), GLM-4.5's dense first layer then its MoE stack, Llama 4's
# chunked dense RoPE layer and global NoPE layer with experts (two groups).
SCANNED = {
    "smollm3": dict(TINY, num_hidden_layers=5, no_rope_layer_interval=2, use_sliding_window=True, sliding_window=3),
    "olmo3": dict(TINY, num_hidden_layers=5, sliding_window=3, sliding_rope_theta=100.0,
                  layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]),
    "glm4_moe": dict(TINY, num_hidden_layers=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                     use_qk_norm=True, moe_dispatch="dense"),
    "llama4": dict(TINY, num_hidden_layers=4, intermediate_size=16, intermediate_size_mlp=40, num_local_experts=4,
                   no_rope_layer_interval=2, interleave_moe_layer_step=2, attention_chunk_size=3, floor_scale=2),
    # Gemma 4's global and sliding layers (one group, the last global layer unrolled), each with its per-layer input,
    # the global ones wider with one key/value head that is the values too (its experts: test_gemma4's resumed run).
    "gemma4": dict(TINY, num_hidden_layers=3, global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
                   sliding_window=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                   vocab_size_per_layer_input=64, hidden_size_per_layer_input=8),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 10)), jnp.int32)


@functools.cache
def unrolled_model(family):
    """(config, model, random params as numpy arrays) of ``family``'s SCANNED layers unrolled; built once for the
    tests below (tracing the init for the shapes costs as much as some of their checks). Numpy leaves: relaid out
    by numpy, where JAX would compile each stacking op for each shape."""
    config = model_config_class(family).model_validate({"name": family, **SCANNED[family]})
    model = build_model(config)
    return config, model, jax.tree.map(np.asarray, random_params(model, TOKENS))


@pytest.mark.parametrize("family", sorted(SCANNED))
def test_scanned_rematerialised_layers_train_as_the_unrolled_ones(family):
    config, unrolled, params = unrolled_model(family)
    scanned = build_model(config.model_copy(update={"scan_layers": True, "remat": "full"}))
    boxed = nn.meta.unbox(jax.eval_shape(scanned.init, jax.random.PRNGKey(0), TOKENS)["params"])
    stacked = relayout_like(params, boxed)
    stacks = {name for name in boxed if name.endswith("_stack")}
    assert stacks == ({"dense_layers_stack", "moe_layers_stack"} if family == "glm4_moe" else {"layers_stack"})

    @jax.jit  # one compile for both layouts
    def loss_and_grads(params, stacked):
        def run(model, p):
            def loss(p):
                out = model.apply({"params": p}, TOKENS[:, :-1])
                logits = jax.nn.log_softmax(logits_of(out))
                return -jnp.mean(jnp.take_along_axis(logits, TOKENS[:, 1:, None], axis=-1))
            return jax.value_and_grad(loss)(p)
        return run(unrolled, params), run(scanned, stacked)

    (value, grads), (scanned_value, scanned_grads) = loss_and_grads(params, stacked)
    np.testing.assert_allclose(scanned_value, value, rtol=1e-6)
    flat = dict(jax.tree_util.tree_flatten_with_path(unstack_layers(jax.tree.map(np.asarray, scanned_grads)))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        np.testing.assert_allclose(flat[path], leaf, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))


def test_smollm3_derives_its_nope_and_sliding_layers_as_transformers_does():
    hf = dict(model_type="smollm3", num_hidden_layers=6, no_rope_layer_interval=3, use_sliding_window=True,
              sliding_window=16)
    theirs = transformers.SmolLM3Config(**hf)
    ours = smollm3_config(hf)
    assert [int(ours.uses_rope(i)) for i in range(6)] == theirs.no_rope_layers == [1, 1, 0, 1, 1, 0]
    assert list(ours.resolved_layer_types()) == theirs.layer_types
    assert [ours.attention_window(i) for i in range(6)] == [None, None, 16, None, None, 16]
    assert [ours.rope_for(i) is None for i in range(6)] == [False, False, True, False, False, True]


def test_olmo3_reads_the_old_rope_layout_as_transformers_does():
    """transformers applies the old ``rope_theta``/``rope_scaling`` to the full-attention layers alone; the sliding
    ones keep its default theta (OLMo 3's released configs use this layout)."""
    scaling = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=8192, attention_factor=1.2)
    hf = dict(model_type="olmo3", num_hidden_layers=4, rope_theta=1e6, rope_scaling=scaling, sliding_window=8)
    theirs = transformers.Olmo3Config(**hf).rope_parameters
    ours = olmo3_config(hf)
    assert theirs["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}
    assert (ours.sliding_rope_theta, ours.sliding_rope_scaling) == (500000.0, None)
    assert {"rope_theta": ours.rope_theta, **ours.rope_scaling.model_dump(exclude_none=True)} == theirs["full_attention"]
    assert ours.rope_for(3) is ours and ours.rope_for(0).rope_theta == 500000.0  # layer 3 is the full one


def test_glm4_moe_reads_the_released_config_layout_as_transformers_does():
    # GLM-4.5-Air's config.json keys: top-level rope_theta and partial_rotary_factor, an MTP layer.
    hf = dict(model_type="glm4_moe", hidden_size=4096, num_attention_heads=96, head_dim=128, rope_theta=1e6,
              partial_rotary_factor=0.5, num_nextn_predict_layers=1, use_qk_norm=False, attention_bias=True,
              num_hidden_layers=46, first_k_dense_replace=1, n_routed_experts=128, moe_intermediate_size=1408)
    theirs = transformers.Glm4MoeConfig(**hf)
    ours = glm4_moe_config(hf)
    assert (ours.rope_theta, ours.rotary_dim, ours.attn_head_dim) == (theirs.rope_parameters["rope_theta"], 64, 128)
    assert ours.decoder_shape().mlp_width == round((45 * 9 * 1408 + 10944) / 46)
    without = {**{k: v for k, v in hf.items() if k != "head_dim"}, "num_attention_heads": 64}
    assert glm4_moe_config(without).attn_head_dim == 4096 // 64  # transformers' head_dim then


def test_glm4_moe_keeps_its_multi_token_prediction_layer(tmp_path, highest_precision):
    """GLM-4.5's multi-token-prediction layer (its decoder layer GLM's, the head tied here) computes the report's
    equations as DeepSeek-V3's does and converts both ways."""
    full = build_family_model("glm4_moe_all_sparse_tied", num_hidden_layers=4)
    params, config = check_against_the_reference(tmp_path / "hf", *with_mtp_layers(full, tmp_path / "hf", 3), 3)
    assert config.num_nextn_predict_layers == 1 and config.tie_word_embeddings
    assert_round_trip(params, config, tmp_path / "hf", tmp_path / "out")


def test_glm4_moe_correction_biases_stay_out_of_the_optimizer():
    _, model, params = unrolled_model("glm4_moe")
    frozen = [path for path, trainable in jax.tree_util.tree_flatten_with_path(model.trainable_mask(params))[0]
              if not trainable]
    assert [jax.tree_util.keystr(path) for path in frozen] == [
        f"['moe_layers_{j}']['e_score_correction_bias']" for j in range(3)]


def test_llama4_reads_its_layer_lists_as_transformers_does():
    hf = dict(model_type="llama4_text", num_hidden_layers=6, no_rope_layers=[], interleave_moe_layer_step=3,
              attention_chunk_size=16)
    theirs = transformers.Llama4TextConfig(**hf)
    ours = llama4_config(hf)
    assert [int(ours.uses_rope(i)) for i in range(6)] == theirs.no_rope_layers == [1, 1, 1, 0, 1, 1]
    assert [i for i in range(6) if ours.moe_layer(i)] == theirs.moe_layers == [2, 5]
    assert list(ours.resolved_layer_types()) == theirs.layer_types
    assert [ours.attention_chunk(i) for i in range(6)] == [16, 16, 16, None, 16, 16]
    unchunked = llama4_config({**hf, "attention_chunk_size": None})
    assert set(unchunked.resolved_layer_types()) == {"full_attention"}


def test_llama4_packed_documents_are_chunked_from_their_own_starts(highest_precision):
    _, model, params = unrolled_model("llama4")
    rng = np.random.default_rng(3)
    first, second = rng.integers(0, 64, (1, 5)), rng.integers(0, 64, (1, 7))  # the second starts inside a chunk
    apply = jax.jit(lambda tokens, **keywords: logits_of(model.apply({"params": params}, tokens, **keywords)))
    packed = apply(jnp.asarray(np.concatenate([first, second], axis=1)), segment_ids=jnp.asarray([[1] * 5 + [2] * 7]),
                   positions=jnp.asarray([list(range(5)) + list(range(7))]))  # fmt: skip
    alone = apply(jnp.asarray(np.concatenate([np.pad(first, ((0, 0), (0, 2))), second])))  # causal: padding after
    packed, alone = np.asarray(packed), np.asarray(alone)  # sliced by numpy (JAX compiles each slice)
    np.testing.assert_allclose(packed[0, :5], alone[0, :5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, 5:], alone[1], atol=1e-5, rtol=0)


def test_llama4_chunked_attention_run_killed_resumes_bitwise(tmp_path, compilation_cache):
    """A scanned run of a chunked RoPE layer and a global NoPE layer, both with experts (16 tokens in chunks of 6),
    SIGKILLed after a checkpoint and resumed, ends bit-identical (the compilation cache compiles its call once)."""
    model = {"name": "llama4", **SCANNED["llama4"], "vocab_size": 256, "num_hidden_layers": 2,
             "attention_chunk_size": 6, "interleave_moe_layer_step": 1, "scan_layers": True, "remat": "full"}
    # RUN's 4 steps, 2 a call, a checkpoint each call: killed at step 4's call boundary (before its checkpoint), the
    # run resumes from step 2's, as it did with 6 steps, with fewer checkpoints to write.
    run = {**RUN, "model": model}
    whole = tmp_path / "whole"
    functrain.fit(run, **{"run.dir": str(whole)})
    resumed = killed_after_a_save(run, tmp_path / "resumed", kill_step=3)
    assert max(layout.committed_steps(layout.checkpoints_dir(resumed))) == 2  # the resumed run trains a call
    functrain.fit(run, **{"run.dir": str(resumed)})
    assert params_digest(load_params(resumed, 4)) == params_digest(load_params(whole, 4))
    assert _losses(resumed) == _losses(whole)
