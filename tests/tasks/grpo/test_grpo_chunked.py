"""GRPO's log-probs over chunks of positions (``train.logits_chunk``, functrain/core/unembedding.py): the loss, its
metrics and its gradient equal the whole logits' (float32, 1e-6), the policy's and the reference's logits never
whole."""

import jax
import numpy as np

from functrain.core.adapters import model_pieces
from functrain.core.unembedding import chunk_loops_traced
from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from functrain.tasks.grpo.loss import LossSettings, grpo_program
from functrain.tasks.preference.task import chunked_pieces

VOCAB, ROWS, LENGTH = 53, 4, 12


def test_grpo_log_probs_over_chunks_equal_the_whole_logits():
    rng = np.random.default_rng(0)
    mask = (np.arange(LENGTH) >= 5)[None].repeat(ROWS, 0).astype(np.int32)
    mask[1, 9:] = 0  # a shorter completion
    batch = {"tokens": rng.integers(0, VOCAB, (ROWS, LENGTH)).astype(np.int32), "completion_mask": mask,
             "advantages": np.array([1.0, -0.5, 0.25, -0.75], np.float32),
             "batch_rows": np.full(ROWS, ROWS, np.float32), "batch_tokens": np.full(ROWS, mask[:, 1:].sum(), np.float32),
             "sampler_logps": np.zeros((ROWS, LENGTH - 1), np.float32),
             "host_metrics": np.zeros((ROWS, 0), np.float32)}  # fmt: skip
    pieces = model_pieces(build_model(GPTConfig(vocab_size=VOCAB, max_len=16, d_model=16, n_layers=1, n_heads=2,
                                                d_ff=32)), batch["tokens"][:, :-1], batch)  # fmt: skip
    settings = LossSettings(loss_type="grpo", beta=0.04)  # the reference's log-probs too
    programs = [grpo_program(chunked_pieces(pieces, chunk), settings, ()) for chunk in ("off", 4)]
    params, model_state = programs[0].init(jax.random.PRNGKey(0))
    # The reference a little off the policy, so the KL and its gradient are not 0.
    params = jax.tree.map(lambda p: p * 1.01, params)

    @jax.jit
    def both(params):  # one compile for the two programs
        def loss(params, program):
            loss_sum, weight, aux, _ = program.loss_fn(params, model_state, batch, jax.random.PRNGKey(1))
            return loss_sum, aux

        return [jax.value_and_grad(loss, has_aux=True)(params, program) for program in programs]

    with chunk_loops_traced() as loops:
        ((whole, aux), grads), ((chunked, chunked_aux), chunked_grads) = both(params)
    assert loops == [3, 3]  # 11 positions in 3 chunks, the last padded: the policy's and the reference's
    assert abs(float(chunked) - float(whole)) <= 1e-6 * abs(float(whole)) and float(aux["kl"]) > 0
    for name in ("entropy", "kl"):
        np.testing.assert_allclose(chunked_aux[name], aux[name], rtol=1e-6)
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
