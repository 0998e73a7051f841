"""DeepSeek-V3's module: decoding with the compressed-latent cache computes the full forward's logits and continues a
prompt as transformers' greedy ``generate`` does; the cache holds the latent, not per-head keys and values;
``scan_layers`` with ``remat`` trains as the unrolled model does; the auxiliary-loss-free bias update moves the
correction biases by the step's total counts alike for any number of micro-batches, outside the optimizer, and a
killed run with it (and multi-token prediction, functrain.models.mtp) resumes bitwise."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax.traverse_util import flatten_dict
from jax.tree_util import tree_flatten_with_path

from functrain.core.program import as_program
from functrain.core.state import TrainState
from functrain.core.step import make_train_step, trainable_only
from functrain.models import build_model, model_config_class
from functrain.models.kv_cache import zeros_like_shapes
from functrain.models.stacking import relayout_like
from functrain.text.decode import Generator, Sampling
from tests.commands.test_verify_resume import assert_resumes_as_uninterrupted
from tests.torch_bridge.hf.test_hf_convert import highest_precision  # noqa: F401 (a fixture)
from tests.torch_bridge.hf.test_hf_deepseek_v3 import TINY, VOCAB, build_deepseek
from torch_bridge.hf import load_pretrained

PROMPT = np.array([[5, 17, 42, 8, 3], [60, 2, 9, 33, 11]])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """transformers' tiny DeepSeek-V3 (YaRN, q LoRA) and the same weights loaded into functrain."""
    hf_model = build_deepseek("q_lora_yarn")
    directory = tmp_path_factory.mktemp("deepseek")
    hf_model.save_pretrained(directory)
    _, params, config = load_pretrained(directory)
    return hf_model, params, config


def _logits(output):
    return getattr(output, "logits", output)


def cache_shapes(model, params, tokens):
    """The shapes of ``model``'s generation cache for ``tokens``' batch and length."""
    return jax.eval_shape(
        lambda: model.apply({"params": params}, jnp.zeros(tokens.shape, jnp.int32), mutable=["cache"])[1]["cache"]
    )


def decoded_and_full_logits(model, params, tokens, spans):
    """``model``'s logits of ``tokens`` fed to its cache span by span (``(start, stop)`` pairs), and of the whole
    sequence at once."""
    full = _logits(jax.jit(model.apply)({"params": params}, tokens))
    feed = jax.jit(lambda cache, new: model.apply({"params": params, "cache": cache}, new, mutable=["cache"]))
    # The cache's zeros made by one program and the spans cut on the host: op by op, each compiles one of its own.
    shapes = cache_shapes(model, params, tokens)
    cache, pieces, rows = jax.jit(lambda: zeros_like_shapes(shapes))(), [], np.asarray(tokens)
    for start, stop in spans:
        output, updated = feed(cache, rows[:, start:stop])
        cache = updated["cache"]
        pieces.append(_logits(output))
    return np.concatenate(pieces, axis=1), full


def test_decoding_with_the_latent_cache_computes_the_full_forward(converted, highest_precision):
    _, params, config = converted
    model = build_model(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 10)))
    attention = cache_shapes(model, params, tokens)["dense_layers_0"]["self_attn"]
    assert {name: leaf.shape for name, leaf in attention.items()} == {
        "cache_index": (), "cached_latent": (2, 10, config.kv_lora_rank),
        "cached_rotary_key": (2, 10, config.qk_rope_head_dim),
    }  # fmt: skip
    spans = ((0, 6), (6, 7), (7, 8), (8, 9), (9, 10))  # a prompt, then one token at a time
    decoded, full = decoded_and_full_logits(model, params, tokens, spans)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=0)


def test_greedy_generation_continues_as_transformers_does(converted, highest_precision):
    hf_model, params, config = converted
    hf_model.generation_config.eos_token_id = None  # the full length, as functrain generates
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor(PROMPT), max_new_tokens=12, do_sample=False)
    got = Generator(build_model(config))(params, PROMPT, Sampling(12))
    np.testing.assert_array_equal(got, expected.numpy()[:, PROMPT.shape[1] :])


def test_scanned_layers_with_remat_train_as_the_unrolled_ones(converted, highest_precision):
    _, params, config = converted
    unrolled = build_model(config)
    scanned = build_model(config.model_copy(update={"scan_layers": True, "remat": "full"}))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 9)))
    boxed = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), tokens)["params"]
    assert {"dense_layers_stack", "moe_layers_stack"} <= set(boxed)
    stacked = relayout_like(params, nn.meta.unbox(boxed))

    def loss(model, p):
        logits = _logits(model.apply({"params": p}, tokens[:, :-1]))
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    value, grads = jax.jit(jax.value_and_grad(lambda p: loss(unrolled, p)))(params)
    scanned_value, scanned_grads = jax.jit(jax.value_and_grad(lambda p: loss(scanned, p)))(stacked)
    np.testing.assert_allclose(scanned_value, value, rtol=1e-6)
    # Unstacked on the host: each slice of a device array compiles a program of its own.
    unstacked = relayout_like(jax.device_get(scanned_grads), grads)
    for got, want in zip(jax.tree.leaves(unstacked), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------- bias update

# One MoE layer after one dense layer, each expert's selections counted over the step.
BALANCED = dict(TINY, name="deepseek_v3", vocab_size=VOCAB, num_hidden_layers=2, bias_update_rate=0.01,
                initializer_range=0.2)


def _two_steps_each(micro_batchings: tuple[int, ...], tokens: np.ndarray) -> list[TrainState]:
    """Two AdamW steps (weight decay on) of a DeepSeek-V3 with the bias update on, from one initial state, for each
    number of micro-batches; the final TrainStates."""
    config = model_config_class("deepseek_v3").model_validate(BALANCED)
    batch = {"tokens": tokens, "weight": np.ones(len(tokens), np.float32)}
    program = as_program(build_model(config), batch)
    # Initialised once, compiled whole: run op by op, the init compiles a small program for each op.
    params, model_state = jax.jit(program.init)(jax.random.PRNGKey(0))
    trainable = program.trainable(params)
    tx = trainable_only(optax.adamw(1e-2, weight_decay=0.1), trainable)
    initial = jax.jit(lambda: TrainState.create(params, tx, jax.random.PRNGKey(1), model_state))()
    states = []
    for micro_batches in micro_batchings:
        step = jax.jit(make_train_step(program.loss_fn, tx, micro_batches=micro_batches, stateful=True,
                                       trainable=trainable, end_of_step=program.end_of_step))  # fmt: skip
        state = initial
        for _ in range(2):
            state, _ = step(state, batch)
        states.append(state)
    return states


def _biases(params):
    return {path: leaf for path, leaf in flatten_dict(params).items() if path[-1] == "e_score_correction_bias"}


def test_bias_update_moves_the_bias_alike_for_any_micro_batching():
    tokens = np.random.default_rng(3).integers(0, VOCAB, (8, 9))
    whole, split = _two_steps_each((1, 4), tokens)
    biases = _biases(whole.params)
    assert len(biases) == 1  # the MoE layer
    for path, bias in biases.items():
        # Two steps of +-0.01 (or 0 at the mean) from zero: moved by the counts alone, bitwise alike when split.
        steps = np.asarray(bias) / 0.01
        np.testing.assert_allclose(steps, np.round(steps), atol=1e-4)
        assert np.abs(steps).max() == pytest.approx(2)
        np.testing.assert_array_equal(_biases(split.params)[path], bias)
    # The counts restart from zero each step; no optimizer state is kept for the frozen biases.
    assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(whole.model_state["router_counts"]))
    assert not any("e_score_correction_bias" in str(path) for path, _ in tree_flatten_with_path(whole.opt_state)[0])


def test_killed_run_resumes_bitwise_with_the_bias_update_and_multi_token_prediction(tmp_path):
    """verify-resume's check (one subprocess: the SIGKILLed run) over 4 steps killed at a random one."""
    # A multi-token-prediction module (an MoE layer with its own correction bias) trained beside the model, whose one
    # layer is an MoE layer (a dense layer before it, compiled and traced in all three runs, adds nothing to resuming).
    model = {**BALANCED, "vocab_size": 256, "max_position_embeddings": 64, "num_nextn_predict_layers": 1,
             "num_hidden_layers": 1, "first_k_dense_replace": 0}  # fmt: skip
    # No evaluation split: the check compares the training metrics, and an evaluation would compile a program more.
    config = {"seed": 0, "model": model,
              "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 4, "eval_fraction": 0.0},
              "optimizer": {"name": "adamw", "learning_rate": 0.01}, "train": {"steps_per_call": 1}}  # fmt: skip
    assert_resumes_as_uninterrupted(config, tmp_path, 4, ["eval.every_steps=0"])


def _assert_end_of_step_updates_the_bias(program, batch):
    """The Program runs the model's end_of_step on the selection counts its loss returns beside the frozen
    reference, and it updates the router's bias (traced only)."""
    from functrain.models.deepseek_v3 import COUNTS_COLLECTION
    from functrain.tasks.reference import REFERENCE

    assert program.end_of_step is not None
    key = jax.random.PRNGKey(0)
    params, model_state = jax.eval_shape(program.init, key)
    new_state = jax.eval_shape(program.loss_fn, params, model_state, batch, key)[3]
    assert set(new_state) == {COUNTS_COLLECTION, REFERENCE}
    new_params, updated = jax.eval_shape(program.end_of_step, params, new_state)
    assert set(updated) == {COUNTS_COLLECTION, REFERENCE} and len(_biases(new_params)) == 1


def test_preference_training_carries_the_bias_update():
    """DPO on DeepSeek-V3 (a frozen reference copy in the model state): its Program runs the model's end_of_step,
    and the policy's loss returns the selection counts that update reads beside the reference (traced only: the
    step applying end_of_step is tested above)."""
    from functrain.tasks.preference.loss import PreferenceSettings
    from functrain.tasks.preference.task import preference_program_of

    rows = np.random.default_rng(4).integers(0, VOCAB, (4, 9))
    mask = np.ones((4, 9), np.float32)
    batch = {"chosen": rows[:2], "rejected": rows[2:], "chosen_mask": mask[:2], "rejected_mask": mask[2:],
             "weight": np.ones(2, np.float32)}
    model = build_model(model_config_class("deepseek_v3").model_validate(BALANCED))
    program = preference_program_of(model, batch, PreferenceSettings("sigmoid"))
    _assert_end_of_step_updates_the_bias(program, batch)


def test_grpo_training_carries_the_bias_update():
    """GRPO on DeepSeek-V3 (beta > 0: a frozen reference copy in the model state): as DPO's above, its Program runs
    the model's end_of_step on the selection counts the policy's loss returns (traced only)."""
    from functrain.core.adapters import model_pieces
    from functrain.tasks.grpo.loss import LossSettings, grpo_program

    tokens = np.random.default_rng(5).integers(0, VOCAB, (4, 9)).astype(np.int32)
    batch = {"tokens": tokens, "completion_mask": np.ones((4, 9), np.int32), "advantages": np.ones(4, np.float32),
             "batch_rows": np.full(4, 4.0, np.float32), "batch_tokens": np.full(4, 32.0, np.float32),
             "sampler_logps": np.zeros((4, 8), np.float32), "host_metrics": np.zeros((4, 0), np.float32)}
    model = build_model(model_config_class("deepseek_v3").model_validate(BALANCED))
    program = grpo_program(model_pieces(model, tokens[:, :-1], batch), LossSettings(beta=0.04), ())
    _assert_end_of_step_updates_the_bias(program, batch)
