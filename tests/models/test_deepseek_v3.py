"""DeepSeek-V3's module: decoding with the compressed-latent cache computes the full forward's logits and continues a
prompt as transformers' greedy ``generate`` does; the cache holds the latent, not per-head keys and values;
``scan_layers`` with ``remat`` trains as the unrolled model does."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from functrain.models import build_model
from functrain.models.kv_cache import zeros_like_shapes
from functrain.models.stacking import relayout_like
from functrain.text.decode import Generator, Sampling
from tests.torch_bridge.hf.test_hf_convert import highest_precision  # noqa: F401 (a fixture)
from tests.torch_bridge.hf.test_hf_deepseek_v3 import VOCAB, build_deepseek
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


def test_decoding_with_the_latent_cache_computes_the_full_forward(converted, highest_precision):
    _, params, config = converted
    model = build_model(config)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 10)))
    full = _logits(model.apply({"params": params}, tokens))
    shapes = jax.eval_shape(
        lambda: model.apply({"params": params}, jnp.zeros((2, 10), jnp.int32), mutable=["cache"])[1]["cache"]
    )
    attention = shapes["dense_layers_0"]["self_attn"]
    assert {name: leaf.shape for name, leaf in attention.items()} == {
        "cache_index": (), "cached_latent": (2, 10, config.kv_lora_rank),
        "cached_rotary_key": (2, 10, config.qk_rope_head_dim),
    }  # fmt: skip
    cache, pieces = zeros_like_shapes(shapes), []
    for start, stop in ((0, 6), (6, 7), (7, 8), (8, 9), (9, 10)):  # a prompt, then one token at a time
        output, updated = model.apply({"params": params, "cache": cache}, tokens[:, start:stop], mutable=["cache"])
        cache = updated["cache"]
        pieces.append(_logits(output))
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


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

    value, grads = jax.value_and_grad(lambda p: loss(unrolled, p))(params)
    scanned_value, scanned_grads = jax.value_and_grad(lambda p: loss(scanned, p))(stacked)
    np.testing.assert_allclose(scanned_value, value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(relayout_like(scanned_grads, grads)), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
