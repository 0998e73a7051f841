"""Packed token windows: segment ids, positions and the loss mask follow the store's document boundaries."""

import numpy as np

from functrain.data.token_store import StoreWriter, TokenStore
from functrain.data.token_windows import TokenWindows

LENGTHS = [3, 5, 2, 7, 4]  # documents of the stream [0, 3), [3, 8), [8, 10), [10, 17), [17, 21)


def _store(tmp_path, lengths=LENGTHS):
    with StoreWriter(tmp_path / "store", 256, {"name": "test", "xxh64": None, "eos_id": None}) as writer:
        writer.add([np.full(length, 10 + doc) for doc, length in enumerate(lengths)])
    return TokenStore.open(tmp_path / "store")


def test_packing_fields_follow_document_boundaries(tmp_path):
    windows = TokenWindows(_store(tmp_path), seq_len=6, packing=True)
    batch = windows.gather(np.array([0, 1]))
    assert batch["tokens"].tolist() == [[10, 10, 10, 11, 11, 11, 11], [11, 11, 12, 12, 13, 13, 13]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2], [1, 1, 2, 2, 3, 3, 3]]
    # The window that starts inside document 1 counts its positions from the window's start.
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 0, 1, 0, 1, 2]]
    # No token predicts the first token of the next document.
    assert batch["mask"].tolist() == [[1, 1, 0, 1, 1, 1], [1, 0, 1, 0, 1, 1]]


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
