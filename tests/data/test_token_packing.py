"""Packed token windows: segment ids and positions follow the store's document boundaries, and a model
trained on them never attends or predicts across documents."""

import jax
import numpy as np

from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from functrain.core.program import as_program
from functrain.core.losses import model_inputs, model_keywords

from functrain.data.token_store import StoreWriter, TokenStore
from functrain.data.token_windows import TokenWindows

LENGTHS = [3, 5, 2, 7, 4]  # documents of the stream [0, 3), [3, 8), [8, 10), [10, 17), [17, 21)


def _store(tmp_path, lengths=LENGTHS):
    with StoreWriter(tmp_path / "store", 256, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add(np.repeat(10 + np.arange(len(lengths)), lengths), lengths)
    return TokenStore.open(tmp_path / "store")


def test_packing_fields_follow_document_boundaries(tmp_path):
    windows = TokenWindows(_store(tmp_path), seq_len=6, packing=True)
    batch = windows.gather(np.array([0, 1]))
    assert batch["tokens"].tolist() == [[10, 10, 10, 11, 11, 11, 11], [11, 11, 12, 12, 13, 13, 13]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 3, 3, 3]]
    # The window that starts inside document 1 counts its positions from the window's start.
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 0, 1, 2]]


def test_unpacked_windows_carry_only_tokens(tmp_path):
    windows = TokenWindows(_store(tmp_path), seq_len=6)
    assert len(windows) == 3 and set(windows.gather(np.array([2]))) == {"tokens"}
    assert windows.gather(np.array([2]))["tokens"].dtype == np.int32


def test_packing_fields_match_a_token_by_token_reference(tmp_path):
    """Random document lengths (empty documents included) and windows anywhere in the stream."""
    rng = np.random.default_rng(0)
    store = _store(tmp_path, rng.integers(0, 12, 300).tolist())
    windows = TokenWindows(store, seq_len=16, packing=True)
    indices = rng.permutation(len(windows))[:40]
    batch = windows.gather(indices)
    for row, index in enumerate(indices):
        offsets = index * 16 + np.arange(17)
        document = np.searchsorted(store.doc_starts, offsets, side="right") - 1
        assert np.array_equal(batch["segment_ids"][row], np.unique(document, return_inverse=True)[1] + 1)
        segment_start = np.maximum(np.asarray(store.doc_starts)[document], offsets[0])
        assert np.array_equal(batch["positions"][row], offsets - segment_start)


def test_packed_windows_never_attend_or_predict_across_documents(tmp_path):
    """A window packing three documents through the training loss (model keywords from the batch, built-in
    causal-LM loss): each document's logits equal those of the document run alone, and the loss sums to the
    documents' own losses. Ignoring the segment ids or positions anywhere breaks both."""
    lengths, seq_len = [5, 7, 4], 15
    rng = np.random.default_rng(0)
    with StoreWriter(tmp_path / "store", 64, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add(rng.integers(0, 64, sum(lengths)), lengths)
    packed = TokenWindows(TokenStore.open(tmp_path / "store"), seq_len, packing=True).gather(np.array([0]))
    packed["weight"] = np.ones(1, np.float32)
    model = build_model(GPTConfig(name="gpt", vocab_size=64, max_len=16, d_model=32, n_layers=1, n_heads=2,
                                  d_ff=64, dropout=0.0))
    program = as_program(model, packed)
    params, model_state = jax.jit(program.init)(jax.random.PRNGKey(0))

    @jax.jit
    def loss_and_logits(batch):
        loss_sum, weight, _, _ = program.eval_loss_fn(params, model_state, batch, jax.random.PRNGKey(1))
        logits = model.apply({"params": params}, model_inputs("causal_lm", batch), **model_keywords("causal_lm", batch))
        return loss_sum, weight, logits

    # The documents alone: one per row, padded at the end (causal: padding changes no earlier logit) and
    # masked out of the loss.
    starts = np.cumsum([0] + lengths[:-1])
    alone = {"tokens": np.zeros((len(lengths), max(lengths)), np.int32), "weight": np.ones(len(lengths), np.float32),
             "mask": np.arange(max(lengths) - 1)[None, :] < np.array(lengths)[:, None] - 1}
    for row, (start, length) in enumerate(zip(starts, lengths)):
        alone["tokens"][row, :length] = packed["tokens"][0, start:start + length]
    packed_sum, packed_weight, packed_logits = loss_and_logits(packed)
    alone_sum, alone_weight, alone_logits = loss_and_logits(alone)
    for row, (start, length) in enumerate(zip(starts, lengths)):
        np.testing.assert_allclose(packed_logits[0, start:start + length - 1], alone_logits[row, :length - 1],
                                   atol=1e-5)
    assert float(packed_weight) == float(alone_weight) == sum(lengths) - len(lengths)
    np.testing.assert_allclose(float(packed_sum), float(alone_sum), rtol=1e-5)
