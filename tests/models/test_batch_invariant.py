"""``model.batch_invariant``: decoding with a KV cache (one token at a time, in a cache longer than the text; GRPO's
tests hold a prompt fed at once, tests/tasks/grpo/test_grpo_run.py) gives the log-probs of the whole-sequence forward bit for bit, at every batch size, for GPT and for a Qwen3 with
grouped-query heads, in float32 and bfloat16 compute; the option's config rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.config.load import load_config
from functrain.core.model_output import logits_of
from functrain.errors import ConfigError
from functrain.models import build_model, model_config_class
from functrain.models.kv_cache import empty_cache
from functrain.tasks.sampling import INVARIANT_OPTIONS, ONE_THREAD

LENGTH, CACHE = 13, 19  # the cache runs 6 positions past the text
MODELS = {
    "gpt": dict(name="gpt", vocab_size=61, max_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.0),
    "qwen3": dict(name="qwen3", vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32),
}  # fmt: skip


def _log_probs(output):
    return jax.nn.log_softmax(logits_of(output), axis=-1)


def decoded_log_probs(model, params, tokens):
    """The log-probs of ``tokens`` fed one by one to a cache of CACHE positions (one compiled model in a scan)."""

    def one(cache, token):
        output, updated = model.apply({"params": params, "cache": cache}, token[:, None], mutable=["cache"])
        return updated["cache"], _log_probs(output)[:, 0]

    _, log_probs = jax.lax.scan(one, empty_cache(model, params, tokens.shape[0], CACHE), tokens.T)
    return log_probs.transpose(1, 0, 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(MODELS))
def test_decoding_gives_the_whole_forward_s_log_probs_bit_for_bit_at_every_batch_size(family, dtype):
    model = build_model(model_config_class(family)(**MODELS[family], batch_invariant=True), dtype)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 61, (8, LENGTH)), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens[:1])["params"]
    whole = jax.jit(lambda p, t: _log_probs(model.apply({"params": p}, t)), compiler_options=INVARIANT_OPTIONS)
    decode = jax.jit(lambda p, t: decoded_log_probs(model, p, t), compiler_options={**INVARIANT_OPTIONS, **ONE_THREAD})
    expected = np.asarray(whole(params, tokens))
    for rows in (1, 3, 8):
        np.testing.assert_array_equal(np.asarray(decode(params, tokens[:rows])), expected[:rows])


def test_the_option_is_off_by_default_and_refused_where_unsupported():
    assert load_config("configs/grpo_char_gpt.yaml").model.batch_invariant is False
    assert load_config("configs/grpo_char_gpt.yaml", ["model.batch_invariant=true"]).model.batch_invariant is True
    assert load_config("configs/char_gpt.yaml", ["model.batch_invariant=true"]).model.batch_invariant is True
    with pytest.raises(ConfigError, match=r"model.batch_invariant is not supported by model gpt2 \(only by gpt, "):
        load_config("configs/finetune_gpt2.yaml", ["model.batch_invariant=true"])
