"""Chunked cross-entropy (functrain/core/unembedding.py): the LM loss and the preference log-probs formed over
chunks of positions equal the whole logits' (values and gradients, float32, 1e-6) with every weighting of the
targets; ``auto`` chunks only large logits, and then never holds them whole; a bad chunk setting is one line."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.core.losses import causal_lm_sums
from functrain.core.program import as_program, builtin_task_loss, task_program
from functrain.core.adapters import model_pieces
from functrain.core.unembedding import AUTO_WHOLE_BYTES, Unembedding, chunk_loops_traced, chunk_positions
from functrain.models import build_model
from functrain.models.gemma2 import soft_cap
from functrain.models.gpt import GPTConfig
from functrain.models.llama import LlamaConfig
from functrain.tasks.preference.loss import completion_logps

VOCAB, LENGTH = 61, 12


def weighted_batch() -> dict[str, np.ndarray]:
    """An LM batch with every kind of target weighting: HF labels with -100, a per-target mask, packed
    segments, a padding row (weight 0)."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (3, LENGTH)).astype(np.int32)
    labels = tokens.copy()
    labels[0, 3:6] = -100
    mask = np.ones((3, LENGTH - 1), np.float32)
    mask[1, :4] = 0
    segments = np.repeat([[0] * 5 + [1] * 7], 3, axis=0).astype(np.int32)
    return {"tokens": tokens, "labels": labels, "mask": mask, "segment_ids": segments,
            "weight": np.array([1.0, 1.0, 0.0], np.float32)}


GPT = GPTConfig(vocab_size=VOCAB, max_len=16, d_model=16, n_layers=1, n_heads=2, d_ff=32)  # an untied head
LLAMA = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,  # a tied one
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, tie_word_embeddings=True)


def test_the_chunked_lm_loss_and_its_gradient_equal_the_whole_logits():
    batch = weighted_batch()
    pieces = model_pieces(build_model(GPT), batch["tokens"][:, :-1], batch)
    params, model_state = pieces.init(jax.random.PRNGKey(0))

    def loss(params, chunk):
        loss_sum, weight, aux, _ = task_program(pieces, builtin_task_loss("causal_lm", None, chunk)).eval_loss_fn(
            params, model_state, batch, jax.random.PRNGKey(1))
        return loss_sum, (weight, aux)

    @jax.jit
    def both(params):  # one compile for the two losses
        return [jax.value_and_grad(loss, has_aux=True)(params, chunk) for chunk in ("off", 4)]

    with chunk_loops_traced() as loops:
        ((whole, (weight, aux)), grads), ((chunked, (chunked_weight, chunked_aux)), chunked_grads) = both(params)
    assert loops == [3]  # 11 positions: 3 chunks, the last padded
    assert abs(float(chunked) - float(whole)) <= 1e-6 * abs(float(whole))
    assert float(chunked_weight) == float(weight) and float(chunked_aux["accuracy"]) == float(aux["accuracy"])
    assert 0 < float(weight) < 2 * (LENGTH - 1)  # the weighting held: -100, mask and segment starts left out
    for got, want in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_as_program_chunks_the_lm_loss_as_a_run_asks():
    # Research code's entry takes the run's train.logits_chunk (bench_mfu measured whole logits before it did).
    batch = {"tokens": weighted_batch()["tokens"], "weight": np.ones(3, np.float32)}
    model = build_model(GPT)
    counts = []
    for chunk in ("off", 4):
        program = as_program(model, batch, kind="causal_lm", logits_chunk=chunk)
        params, model_state = jax.eval_shape(program.init, jax.random.PRNGKey(0))
        with chunk_loops_traced() as loops:
            jax.eval_shape(program.loss_fn, params, model_state, batch, jax.random.PRNGKey(1))
        counts.append(loops)
    assert counts == [[], [3]]  # 11 positions in chunks of 4


def test_a_tied_head_unapplied_gives_the_logits_of_the_embedding():
    tokens = weighted_batch()["tokens"][:, :-1]
    model = build_model(LLAMA)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    head = model.apply({"params": params}, tokens, logits_chunk=4)
    assert isinstance(head, Unembedding) and head.chunk == 4
    assert head.weight.shape == (16, VOCAB)  # the input embedding, transposed: no parameter of its own
    np.testing.assert_allclose(head.whole_logits(), model.apply({"params": params}, tokens), rtol=1e-6, atol=1e-6)


def random_head(finish=None, chunk=3):
    keys = jax.random.split(jax.random.PRNGKey(2), 2)
    hidden = jax.random.normal(keys[0], (4, 10, 8))
    weight = jax.random.normal(keys[1], (8, VOCAB)) * 3
    return Unembedding(hidden, weight, chunk, finish)


def test_preference_log_probs_over_chunks_equal_the_whole_logits_with_a_soft_cap():
    tokens = np.random.default_rng(1).integers(0, VOCAB, (4, 11)).astype(np.int32)
    mask = (np.arange(11) >= 4)[None].repeat(4, 0)
    head = random_head(functools.partial(soft_cap, cap=5.0))

    def logps(hidden, weight, chunk):
        value = Unembedding(hidden, weight, chunk, head.finish)
        return completion_logps(value if chunk else value.whole_logits(), tokens, mask)[0].sum()

    value_and_grad = jax.jit(jax.value_and_grad(logps, argnums=(0, 1)), static_argnums=2)
    whole, whole_grads = value_and_grad(head.hidden, head.weight, None)
    with chunk_loops_traced() as loops:
        chunked, chunked_grads = value_and_grad(head.hidden, head.weight, 3)
    assert loops == [4]
    assert abs(float(chunked) - float(whole)) <= 1e-6 * abs(float(whole))
    for got, want in zip(chunked_grads, whole_grads):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_auto_chunks_only_large_logits_and_then_never_holds_them_whole():
    def shaped(batch, length, vocab):
        return Unembedding(jax.ShapeDtypeStruct((batch, length, 8), jnp.float32),
                           jax.ShapeDtypeStruct((8, vocab), jnp.float32), "auto")

    assert chunk_positions(shaped(4, 64, VOCAB)) is None  # small: whole
    assert chunk_positions(shaped(1, 8192, 262_144)) == 128  # Gemma 3's vocabulary: 8 GiB whole, 128 MiB chunks
    assert chunk_positions(jnp.zeros((1, 2, 3))) is None  # logits already: nothing to chunk
    large = shaped(1, 2048, 65_536)  # 512 MiB of float32 logits
    whole_bytes = 2048 * 65_536 * 4
    assert whole_bytes > AUTO_WHOLE_BYTES and chunk_positions(large) == 512

    def loss(hidden, weight, tokens):
        batch = {"tokens": tokens, "weight": jnp.ones(1)}
        return causal_lm_sums(Unembedding(hidden, weight, "auto"), batch)[0]

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(
        large.hidden, large.weight, jax.ShapeDtypeStruct((1, 2049), jnp.int32)).compile()
    # Whole, the logits and their gradient alone would take 1 GiB; a chunk's take 256 MiB.
    assert compiled.memory_analysis().temp_size_in_bytes < whole_bytes


@pytest.mark.parametrize("value", ["0", "-3", "chunky", "true"])
def test_a_bad_chunk_setting_is_one_line_exit_2(value, tmp_path, capsys):
    from functrain.commands.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "configs/char_gpt.yaml", f"train.logits_chunk={value}", f"run.dir={run_dir}"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "train.logits_chunk" in lines[0], lines
    assert "'auto', 'off' or a number of positions per chunk" in lines[0]
    assert not run_dir.exists()


def test_off_auto_and_a_number_are_read_from_yaml():
    from functrain.config.load import load_config

    base = {"model": {"name": "gpt"}, "data": {"name": "char_text"}}
    chunks = [load_config(base=base, overrides=[f"train.logits_chunk={value}"]).train.logits_chunk
              for value in ("off", "auto", "256")]
    assert chunks == ["off", "auto", 256]  # YAML reads a bare off as false
