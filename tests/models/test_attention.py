"""Fused attention (``jax.nn.dot_product_attention``) against the explicit softmax the models used before,
packed sequences through the three built-in LMs, and ``model.attention`` choices that cannot run here."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.attention import attend, attention_kernel
from functrain.models.gpt import GPTConfig
from functrain.models.gemma2 import Gemma2Config
from functrain.models.gpt2 import GPT2Config
from functrain.models.llama import LlamaConfig
from functrain.models.mistral import MistralConfig
from functrain.core.program import as_program
from functrain.core.adapters import FunctionalModel
from functrain.core.losses import causal_lm_sums, model_keywords


def reference_attention(q, k, v, scale, segment_ids=None):
    """The models' former attention: float32 scores over the full matrix, query heads grouped under their
    key/value head, a causal (and same-segment) mask, softmax, weighted values."""
    batch, length, heads, head_dim = q.shape
    groups = heads // k.shape[2]
    q = q.reshape(batch, length, k.shape[2], groups, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    allowed = jnp.tril(jnp.ones((length, length), bool))[None, None, None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(batch, length, heads, head_dim)


SEGMENTS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, 2], [5, 5, 5, 5, 5, 5, 7, 7, 7, 7]], np.int32)


# (key/value heads, segment ids): multi-head causal, grouped-query and multi-query over packed segments.
CASES = [(4, False), (2, True), (1, True)]


def random_params(model, tokens, seed=0):
    """Parameters of the model's shapes drawn with numpy: compiling jax.random's threefry for every
    initializer would cost a CPU test more than everything it checks."""
    rng = np.random.default_rng(seed)
    shapes = nn.meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"])
    return jax.tree.map(lambda leaf: jnp.asarray(rng.normal(0, 0.3, leaf.shape), leaf.dtype), shapes)


def test_fused_attention_matches_the_explicit_softmax():
    rng = np.random.default_rng(0)
    inputs = [(rng.normal(size=(2, 10, 4, 8)), *rng.normal(size=(2, 2, 10, kv_heads, 8))) for kv_heads, _ in CASES]

    @jax.jit  # every case in one compile: XLA's compile time dominates this test on a CPU
    def fused_and_reference(inputs):
        results = []
        for (q, k, v), (_, segments) in zip(inputs, CASES):
            segment_ids = jnp.asarray(SEGMENTS) if segments else None
            results.append((attend(q, k, v, scale=0.3, kernel="xla", segment_ids=segment_ids),
                            reference_attention(q, k, v, 0.3, segment_ids)))
        return results

    inputs = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), inputs)
    for (kv_heads, segments), (fused, reference) in zip(CASES, fused_and_reference(inputs)):
        assert fused.shape == (2, 10, 4, 8) and fused.dtype == jnp.float32
        np.testing.assert_allclose(fused, reference, atol=1e-5, rtol=1e-5,
                                   err_msg=f"{kv_heads} key/value heads, segment ids: {segments}")


def test_sinks_take_their_share_of_every_softmax_as_transformers_does():
    """GPT-OSS's sinks as transformers' eager attention writes them (keys repeated per query head, each head's sink
    appended to its scores, softmax, the sink's column dropped), with a window and grouped-query heads, against the
    written-out path ``attend`` takes for them; with very negative sinks it is plain attention again."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 10, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    sinks = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    length = 10
    slots = jnp.arange(length)
    allowed = (slots[:, None] >= slots[None]) & (slots[None] > slots[:, None] - 3)
    scores = jnp.einsum("bthd,bshd->bhts", q, jnp.repeat(k, 2, axis=2)) * 0.3
    scores = jnp.where(allowed, scores, -jnp.inf)
    with_sinks = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (2, 4, length, 1))], -1)
    probs = jax.nn.softmax(with_sinks, axis=-1)[..., :-1]
    expected = jnp.einsum("bhts,bshd->bthd", probs, jnp.repeat(v, 2, axis=2))
    with jax.default_matmul_precision("highest"):
        got = attend(q, k, v, scale=0.3, kernel="xla", window=3, sinks=sinks)
        plain = attend(q, k, v, scale=0.3, kernel="xla", window=3)
        drowned = attend(q, k, v, scale=0.3, kernel="xla", window=3, sinks=jnp.full((4,), -1e4))
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(drowned, plain, atol=1e-6, rtol=1e-6)
    assert float(jnp.max(jnp.abs(got - plain))) > 1e-2


TINY_MODELS = {
    "gpt": GPTConfig(vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64),
    "gpt2": GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4),
    "llama": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
    # A sliding window (the fused kernel's local window) and soft-capped scores (the written-out path).
    "mistral": MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                             sliding_window=3),
    "gemma2": Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                           max_position_embeddings=16, sliding_window=3),
}


def test_a_packed_row_gives_each_document_its_own_logits():
    """Two documents packed into one row with segment ids and restarting positions get the logits each gets
    alone, in GPT, GPT-2, Llama, Mistral (sliding window) and Gemma 2 (soft-capped scores, sliding layers):
    attention stays inside a document and position embeddings / RoPE restart."""
    models = {name: build_model(config) for name, config in TINY_MODELS.items()}
    documents = jnp.stack([jnp.arange(1, 6), jnp.arange(20, 25)])
    packed = documents.reshape(1, 10)
    segment_ids = jnp.asarray([[1] * 5 + [2] * 5], jnp.int32)
    positions = jnp.asarray([list(range(5)) * 2], jnp.int32)

    @jax.jit  # all models in one compile
    def packed_and_alone(params):
        return {name: (model.apply({"params": params[name]}, packed, segment_ids=segment_ids, positions=positions),
                       model.apply({"params": params[name]}, documents)) for name, model in models.items()}

    params = {name: random_params(model, packed) for name, model in models.items()}
    for name, (logits, alone) in packed_and_alone(params).items():
        np.testing.assert_allclose(logits, alone.reshape(1, 10, -1), atol=1e-5, rtol=1e-5, err_msg=name)


def test_the_lm_loss_passes_segments_to_the_model_and_skips_targets_across_documents():
    batch = {"tokens": np.arange(12, dtype=np.int32).reshape(2, 6), "weight": np.ones(2, np.float32),
             "segment_ids": np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 1]], np.int32),
             "positions": np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]], np.int32)}
    keywords = model_keywords("causal_lm", batch)
    assert sorted(keywords) == ["positions", "segment_ids"]
    assert keywords["segment_ids"].shape == (2, 5) and model_keywords("classifier", batch) == {}
    _, weight, _ = causal_lm_sums(jnp.zeros((2, 5, 16)), batch)
    assert float(weight) == 9.0  # 10 targets, one starts the second document of row 0


def test_packed_fields_reach_the_model_through_the_program():
    seen = {}

    def apply(params, tokens, **keywords):
        seen.update({name: value.shape for name, value in keywords.items()})
        return jnp.zeros((*tokens.shape, 16)) + params["bias"]

    batch = {"tokens": np.zeros((2, 6), np.int32), "weight": np.ones(2, np.float32),
             "segment_ids": np.zeros((2, 6), np.int32), "positions": np.zeros((2, 6), np.int32)}
    program = as_program(FunctionalModel(lambda rng, batch: {"bias": jnp.zeros(16)}, apply), batch)
    jax.eval_shape(program.loss_fn, {"bias": jnp.zeros(16)}, {}, batch, jax.random.PRNGKey(0))
    assert seen == {"segment_ids": (2, 5), "positions": (2, 5)}


def test_attention_choices_on_this_platform():
    assert attention_kernel("auto", jnp.bfloat16, 64) == "xla"  # no cuDNN on a CPU
    assert attention_kernel("xla", jnp.float32, 12) == "xla"
    with pytest.raises(ConfigError, match=r"model.attention=cudnn needs an NVIDIA GPU .* devices are cpu; set "
                                          r"model.attention=auto"):
        attention_kernel("cudnn", jnp.bfloat16, 64)
