"""The Gated DeltaNet hybrids' module (Qwen3-Next, Qwen3.5): decoding with the cache (each attention layer's keys
and values, each Gated DeltaNet layer's convolution and delta-rule states) computes the full forward and continues
a prompt as transformers' greedy ``generate`` does; packed documents see nothing of each other; the layers scan by
their repeating group (three Gated DeltaNet layers and one attention layer) and, with remat, train as the unrolled
ones; the plan counts the delta rule's FLOPs; a killed run resumes bitwise; and the family declarations hold."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functrain.config.load import load_config
from functrain.core.model_output import logits_of
from functrain.errors import ConfigError
from functrain.models import build_model, model_config_class
from functrain.models.configs.qwen3_next import delta_rule_flops
from functrain.models.stacking import relayout_like
from functrain.plan.planner import plan
from functrain.text.decode import Generator, Sampling
from tests.commands.test_verify_resume import assert_resumes_as_uninterrupted
from tests.models.test_deepseek_v3 import cache_shapes, decoded_and_full_logits
from tests.torch_bridge.hf.test_hf_convert import highest_precision  # noqa: F401 (a fixture)
from tests.torch_bridge.hf.test_hf_qwen3_next import VOCAB, build_hybrid
from torch_bridge.hf import load_pretrained

PROMPT = np.array([[5, 17, 42, 8, 3, 9, 1], [60, 2, 9, 33, 11, 7, 40]])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """transformers' tiny Qwen3-Next (fused projections, experts, a dense layer, biases, partial scaled RoPE) and the
    same weights loaded into functrain."""
    hf_model = build_hybrid("qwen3_next")
    directory = tmp_path_factory.mktemp("qwen3_next")
    hf_model.save_pretrained(directory)
    _, params, config = load_pretrained(directory)
    return hf_model, params, config.model_copy(update={"linear_chunk_size": 4})


def test_decoding_with_the_cache_computes_the_full_forward(converted, highest_precision):
    _, params, config = converted
    model = build_model(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 10)))
    shapes = cache_shapes(model, params, tokens)
    assert set(shapes["layers_0"]["linear_attn"]) == {"conv_state", "recurrent_state"}
    assert set(shapes["layers_1"]["self_attn"]) == {"cache_index", "cached_key", "cached_value"}
    spans = ((0, 6), (6, 7), (7, 8), (8, 10))  # a prompt, one token at a time, then two at once
    decoded, full = decoded_and_full_logits(model, params, tokens, spans)
    np.testing.assert_allclose(decoded, full, atol=1e-5, rtol=0)


def test_greedy_generation_continues_as_transformers_does(converted, highest_precision):
    hf_model, params, config = converted
    hf_model.generation_config.eos_token_id = None  # the full length, as functrain generates
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor(PROMPT), max_new_tokens=10, do_sample=False)
    got = Generator(build_model(config))(params, PROMPT, Sampling(10))
    np.testing.assert_array_equal(got, expected.numpy()[:, PROMPT.shape[1] :])


# Qwen3.5 (dense) with attention on every other layer: two groups of a Gated DeltaNet layer and an attention layer.
TINY = dict(name="qwen3_5_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=3,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"] * 2, linear_chunk_size=4)  # fmt: skip


def tiny(**change):
    return model_config_class("qwen3_5_text").model_validate({**TINY, **change})


def random_params(model, tokens, seed: int = 0):
    """Parameters of ``model`` drawn around zero (norms around one, as stored zero-centred): no init compiled."""
    abstract = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda leaf: (0.1 * rng.normal(size=leaf.shape)).astype(np.float32), abstract)


def _loss(model, params, tokens, **keywords):
    logits = logits_of(model.apply({"params": params}, tokens[:, :-1], **keywords))
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


def test_the_repeating_group_scans_and_with_remat_trains_as_the_unrolled_layers(highest_precision):
    unrolled, scanned = build_model(tiny()), build_model(tiny(scan_layers=True, remat="full"))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, VOCAB, (2, 11)))
    params = random_params(unrolled, tokens)
    stack = nn.meta.unbox(jax.eval_shape(scanned.init, jax.random.PRNGKey(0), tokens)["params"])
    assert sorted(stack["layers_stack"]) == ["slot_0", "slot_1"]  # the group: Gated DeltaNet, then attention
    assert {"linear_attn", "self_attn"} <= {*stack["layers_stack"]["slot_0"], *stack["layers_stack"]["slot_1"]}
    assert stack["layers_stack"]["slot_0"]["linear_attn"]["A_log"].shape == (2, 4)  # two groups
    stacked = relayout_like(params, stack)
    value, grads = jax.jit(jax.value_and_grad(lambda p: _loss(unrolled, p, tokens)))(params)
    scanned_value, scanned_grads = jax.jit(jax.value_and_grad(lambda p: _loss(scanned, p, tokens)))(stacked)
    np.testing.assert_allclose(scanned_value, value, rtol=1e-6)
    # Unstacked on the host: each slice of a device array compiles a program of its own.
    unstacked = relayout_like(jax.device_get(scanned_grads), grads)
    for got, want in zip(jax.tree.leaves(unstacked), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)


def test_packed_documents_see_nothing_of_each_other(highest_precision):
    model = build_model(tiny())
    rng = np.random.default_rng(3)
    first, second = rng.integers(0, VOCAB, (1, 6)), rng.integers(0, VOCAB, (1, 7))
    params = random_params(model, jnp.asarray(first), seed=1)
    apply = jax.jit(lambda tokens, **keywords: logits_of(model.apply({"params": params}, tokens, **keywords)))
    # The logits brought to the host, where cutting them compiles nothing (each slice of a device array compiles).
    packed = np.asarray(apply(jnp.asarray(np.concatenate([first, second], axis=1)),
                              segment_ids=jnp.asarray([[1] * 6 + [2] * 7]),
                              positions=jnp.asarray([list(range(6)) + list(range(7))])))  # fmt: skip
    alone = np.asarray(apply(jnp.asarray(np.concatenate([np.pad(first, ((0, 0), (0, 1))), second]))))  # padding after
    np.testing.assert_allclose(packed[0, :6], alone[0, :6], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[0, 6:], alone[1], atol=1e-5, rtol=0)


def test_the_shape_counts_the_model_s_own_projections_and_its_mixing():
    config = tiny()  # two Gated DeltaNet layers, two attention layers
    params = nn.meta.unbox(jax.eval_shape(build_model(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 4), int)))

    def matrices(tree):  # the projections' kernels (no norms, gates' parameters or the convolution's taps)
        return sum(leaf.size for leaf in jax.tree.leaves(tree) if leaf.ndim == 2)

    layers = params["params"]
    linear, full = matrices(layers["layers_0"]["linear_attn"]), matrices(layers["layers_1"]["self_attn"])
    shape = config.decoder_shape()
    assert shape.attention_params == round((2 * linear + 2 * full) / 4) and shape.attention_layers == 2
    assert 3 * shape.width * shape.mlp_width == matrices(layers["layers_0"]["mlp"])
    channels = layers["layers_0"]["linear_attn"]["conv1d"]["kernel"].shape[0]
    assert shape.mixer_flops == 2 * (4 * delta_rule_flops(4, 8, 6) + 2 * 3 * channels)


PLANNED = {"name": "qwen3_5_text", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_chunk_size": 16, "max_position_embeddings": 128}  # fmt: skip


def test_the_plan_counts_the_delta_rule_s_flops():
    # Planned on this CPU: the compiled step's FLOPs, every chunk of the delta rule's scan counted, hold the model's
    # analytic FLOPs (the chunked rule's matmuls among them) and what XLA adds to them (the element-wise work, the
    # masked halves of the chunks' score matrices, the softmax): 5% more at these widths.
    data = {"name": "synthetic", "seq_len": 64, "global_batch_size": 2}
    config = load_config(None, [], base={"model": PLANNED, "data": data, "train": {"max_steps": 1}})
    planned = plan(config)
    shape = config.model.decoder_shape()
    assert shape.attention_layers == 1 and shape.mixer_flops > 0
    assert planned.model_flops_per_step <= planned.flops_per_step < 1.15 * planned.model_flops_per_step


def test_a_killed_run_resumes_bitwise(tmp_path):
    """verify-resume's check (one subprocess: the SIGKILLed run) over 4 steps killed at a random one."""
    # One Gated DeltaNet layer and one attention layer; 16 tokens in two chunks.
    model = {**TINY, "vocab_size": 256, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
             "linear_chunk_size": 8}  # fmt: skip
    # No evaluation split: the check compares the training metrics, and an evaluation would compile a program more.
    config = {"seed": 0, "model": model,
              "data": {"name": "char_text", "seq_len": 16, "global_batch_size": 4, "eval_fraction": 0.0},
              "optimizer": {"name": "adamw", "learning_rate": 0.01}, "train": {"steps_per_call": 1}}  # fmt: skip
    assert_resumes_as_uninterrupted(config, tmp_path, 4, ["eval.every_steps=0"])


@pytest.mark.parametrize("mesh, named", [("context", "has none; set mesh.context=1"),
                                         ("pipeline", "does not pipeline them")])  # fmt: skip
def test_what_the_hybrids_do_not_do_is_refused_in_one_line(mesh, named):
    model = {**PLANNED, "scan_layers": True}
    with pytest.raises(ConfigError, match=named) as caught:
        load_config(None, [], base={"model": model, "data": {"name": "synthetic", "seq_len": 8}, "mesh": {mesh: 2}})
    assert "\n" not in str(caught.value)
