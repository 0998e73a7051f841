"""GPT-OSS in functrain's own paths: scanned and rematerialised layers give the unrolled model's loss, gradients and
router statistics, and decoding with the KV cache (sinks, a window shorter than the text) continues as the full
forward passes do. Logits against transformers: ``tests/torch_bridge/hf/test_hf_gpt_oss.py``."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from functrain.models import build_model
from functrain.models.configs.gpt_oss import GptOssConfig
from functrain.models.configs.rope import RopeScaling
from functrain.models.gpt_oss import clamped_swiglu, topk_softmax
from functrain.models.stacking import relayout_like, unstack_layers
from functrain.text.decode import Generator, Sampling
from tests.models.test_attention import random_params

# Sliding, full (transformers' default order): scanned as one group of two layers.
CONFIG = GptOssConfig(
    vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3,
    max_position_embeddings=32, swiglu_limit=0.5, moe_dispatch="dense",  # dense: the cheaper compile here
    rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, truncate=False),
)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


def test_scanned_rematerialised_layers_give_the_unrolled_loss_gradients_and_router_statistics():
    unrolled = build_model(CONFIG)
    scanned = build_model(CONFIG.model_copy(update={"scan_layers": True, "remat": "full"}))
    params = random_params(unrolled, TOKENS)
    stacked = relayout_like(params, nn.meta.unbox(jax.eval_shape(scanned.init, jax.random.PRNGKey(0), TOKENS)["params"]))

    @jax.jit  # one compile for both layouts
    def loss_grads_and_stats(params, stacked):
        def run(model, p):
            def loss(p):
                out = model.apply({"params": p}, TOKENS)
                return jnp.mean(out.logits**2), out.terms.router
            return jax.value_and_grad(loss, has_aux=True)(p)
        return run(unrolled, params), run(scanned, stacked)

    ((loss, stats), grads), ((scanned_loss, scanned_stats), scanned_grads) = loss_grads_and_stats(params, stacked)
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    assert stats.counts.shape == (2, 4) and float(jnp.sum(stats.counts)) == 2 * 24 * 2  # layers, tokens, top-k
    for got, want in zip(jax.tree.leaves(scanned_stats), jax.tree.leaves(stats)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    flat = dict(jax.tree_util.tree_flatten_with_path(unstack_layers(scanned_grads))[0])
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        np.testing.assert_allclose(flat[path], leaf, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    sinks_grad = grads["layers_0"]["self_attn"]["sinks"]
    assert float(jnp.max(jnp.abs(sinks_grad))) > 0  # the sinks train


def test_cached_decoding_with_sinks_and_a_window_continues_as_the_full_forwards_do():
    model = build_model(CONFIG)
    params = random_params(model, TOKENS)
    generate = Generator(model)
    prompt = np.asarray(TOKENS[:, :3])
    sampling = Sampling(max_new_tokens=8)  # greedy, well past the window of 3
    cached = generate(params, prompt, sampling, use_cache=True)
    assert cached.shape == (2, 8)
    np.testing.assert_array_equal(cached, generate(params, prompt, sampling, use_cache=False))


def test_the_router_and_the_activation_are_transformers():
    """transformers' ``GptOssTopKRouter`` (top-k of the biased logits, softmaxed among themselves) and
    ``GptOssExperts._apply_gate`` (clamps, alpha, ``up + 1``), written out."""
    logits = jnp.asarray([[0.5, 2.0, -1.0, 1.0], [3.0, 0.0, 0.1, -2.0]])
    routing = topk_softmax(logits, top_k=2)
    np.testing.assert_array_equal(routing.experts, [[1, 3], [0, 2]])
    top = np.array([[2.0, 1.0], [3.0, 0.1]])
    np.testing.assert_allclose(routing.weights, np.exp(top) / np.exp(top).sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(routing.probs, jax.nn.softmax(logits, -1), rtol=1e-6)
    gate, up = jnp.asarray([-9.0, 0.3, 9.0]), jnp.asarray([-9.0, 0.2, 9.0])
    expected = [(-7 + 1) * -9 / (1 + np.exp(9 * 1.702)), 1.2 * 0.3 / (1 + np.exp(-0.3 * 1.702)),
                8 * 7 / (1 + np.exp(-7 * 1.702))]
    np.testing.assert_allclose(clamped_swiglu(gate, up, alpha=1.702, limit=7.0), expected, rtol=1e-5)
