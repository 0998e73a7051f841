"""The paged sampler (``grpo.sampler: paged``, functrain/text/paged_decode.py) draws the dense sampler's tokens
(``generate_ragged``) for the same keys, with the same log-probs, bit for bit: a GPT in float32 under the sampler's
XLA:CPU options, and a Qwen3 with grouped-query heads in ``model.batch_invariant`` mode; with a slot per row, and
with fewer slots than rows (rows that drew a stop id free their pages and slot for the waiting rows, whose pages
are then reused). Its settings' rules: a page size that does not divide the cache is one error line."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.errors import ConfigError
from functrain.models import build_model, model_config_class
from functrain.models.options import for_sampling
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.paging import paging_of
from functrain.tasks.sampling import DECODER_OPTIONS, INVARIANT_OPTIONS, ONE_THREAD
from functrain.text.decode import generate_ragged
from functrain.text.paged_decode import generate_paged

VOCAB, GROUPS, REPEATS, WIDTH, NEW, PREFILL = 61, 3, 4, 9, 12, 5  # a cache of 20 positions
STOPS = tuple(range(8))  # common enough that most rows end early
MODELS = {
    "gpt": dict(name="gpt", vocab_size=VOCAB, max_len=32, d_model=32, n_layers=1, n_heads=2, d_ff=64, dropout=0.0),
    "qwen3": dict(name="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                  batch_invariant=True),
}  # fmt: skip
SAMPLING = dict(prefill=PREFILL, max_new_tokens=NEW, temperature=1.0, top_k=40, repeats=REPEATS)


def _batch():
    rng = np.random.default_rng(0)
    lengths = np.repeat(rng.integers(PREFILL, WIDTH + 1, GROUPS), REPEATS).astype(np.int32)
    lengths[:REPEATS] = WIDTH  # a prompt that fills the width
    prompts = np.repeat(rng.integers(8, VOCAB, (GROUPS, WIDTH)), REPEATS, axis=0).astype(np.int32)
    prompts[np.arange(WIDTH)[None] >= lengths[:, None]] = 0  # right-padded
    return jnp.asarray(prompts), jnp.asarray(lengths)


@pytest.fixture(scope="module", params=list(MODELS))
def decoders(request):
    """(the dense sampler's tokens and log-probs, a paged sampler of page size and slots, the rows' lengths)."""
    config = model_config_class(request.param)(**MODELS[request.param])
    model = build_model(for_sampling(config))
    prompts, lengths = _batch()
    params = model.init(jax.random.PRNGKey(0), prompts[:1])["params"]
    options = {**(INVARIANT_OPTIONS if config.batch_invariant else DECODER_OPTIONS), **ONE_THREAD}
    key = jax.random.PRNGKey(7)
    dense = jax.jit(lambda p: generate_ragged(model, p, prompts, lengths, key, **SAMPLING), compiler_options=options)

    def paged(page_size, slots):
        def decode(p):
            return generate_paged(
                model, p, prompts, lengths, key, page_size=page_size, slots=slots, stop_ids=STOPS, **SAMPLING
            )

        return jax.jit(decode, compiler_options=options)(params)

    return [np.asarray(array) for array in dense(params)], paged, np.asarray(lengths), params


@pytest.mark.parametrize("page_size, slots", [(4, None), (5, 5)], ids=["a slot per row", "slots refilled"])
def test_paged_decoding_draws_the_dense_tokens_and_log_probs_bit_for_bit(decoders, page_size, slots):
    (dense_tokens, dense_logps), paged, lengths, params = decoders
    tokens, logps = (np.asarray(array) for array in paged(page_size, slots))
    drawn_at = (lengths - PREFILL)[:, None] + np.arange(NEW)
    expected = np.take_along_axis(dense_tokens, drawn_at, 1)
    stopped = np.isin(expected, STOPS)
    ends = np.where(stopped.any(1), stopped.argmax(1) + 1, NEW)  # through each row's first stop id
    assert (ends < NEW).sum() >= len(ends) // 2  # most rows end early: their slots and pages go to waiting rows
    drawn = np.arange(NEW)[None] < ends[:, None]
    np.testing.assert_array_equal(np.take_along_axis(tokens, drawn_at, 1)[drawn], expected[drawn])
    np.testing.assert_array_equal(
        np.take_along_axis(logps, drawn_at, 1)[drawn], np.take_along_axis(dense_logps, drawn_at, 1)[drawn]
    )
    assert (np.take_along_axis(tokens, drawn_at, 1)[~drawn] == 0).all()  # nothing drawn after a stop
    assert np.isnan(np.take_along_axis(logps, drawn_at, 1)[~drawn]).all()


def test_a_page_size_that_does_not_divide_the_cache_is_one_error_line():
    prompts = SimpleNamespace(longest=WIDTH, eos_ids=(0,))
    section = GRPOConfig(sampler="paged", max_completion_length=NEW)
    assert paging_of(section, prompts, episodes=False).page_size == 10  # the largest divisor of 20 up to 16
    assert paging_of(GRPOConfig(max_completion_length=NEW), prompts, episodes=False) is None  # dense: the default
    with pytest.raises(ConfigError, match=r"^grpo.page_size=6 does not divide the paged sampler's cache of 20 posit"):
        paging_of(section.model_copy(update={"page_size": 6}), prompts, episodes=False)
