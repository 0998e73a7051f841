"""``data.name: tokens``: fixed-length training windows over a token store, optionally with packing metadata.

Record ``i`` of a :class:`TokenWindows` is the ``seq_len + 1`` tokens at ``first + i * seq_len`` of the store's
stream (windows overlap by the one token that is both the last target of a window and the first input of the
next). Documents lie end to end in the stream (with the tokenizer's EOS after each, see
:mod:`functrain.text.tokenizer`), so a window may hold the end of one document and the start of the next.

With ``packing=True`` each record also carries, per token of the window:

- ``segment_ids``: which document the token belongs to, numbered from 1 within the window;
- ``positions``: the token's offset in its document, counted from the window's start for the document the
  window begins inside (so positions stay below ``seq_len`` and never exceed the model's context).

The models (GPT, GPT-2, Llama) take both as keyword arguments and attend only within a segment; the causal-LM
loss does not count a target that starts a new segment (see :mod:`functrain.core.losses`), so no document predicts
another.

The evaluation split is the documents after the cut at ``1 - eval_fraction`` of the stream (moved forward to
the next document start), so no document is in both splits and the split never depends on the seed.
"""

from __future__ import annotations

import numpy as np

from functrain.data.token_store import TokenStore
from functrain.errors import DataError


class TokenWindows:
    """Windows of ``seq_len + 1`` tokens over the span ``[first, stop)`` of a store's stream (a Source)."""

    def __init__(
        self, store: TokenStore, seq_len: int, packing: bool = False, first: int = 0, stop: int | None = None
    ) -> None:
        self.store, self.seq_len, self.packing = store, seq_len, packing
        self.first = first
        self.stop = store.num_tokens if stop is None else stop
        self._length = max(self.stop - self.first - 1, 0) // seq_len

    def __len__(self) -> int:
        return self._length

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The windows ``indices`` (``tokens`` [B, seq_len + 1] int32, plus the packing fields)."""
        starts = self.first + np.asarray(indices, np.int64) * self.seq_len
        batch = {"tokens": self.store.read(starts, self.seq_len + 1)}
        if self.packing:
            batch.update(packing_fields(self.store.doc_starts, starts, self.seq_len + 1))
        return batch


def packing_fields(doc_starts: np.ndarray, starts: np.ndarray, length: int) -> dict[str, np.ndarray]:
    """``segment_ids`` and ``positions`` ([B, length] int32) of the windows ``[start, start + length)``, from
    the document start offsets. Two binary searches per window find the document starts inside it; only those
    index entries are read."""
    first_doc = np.searchsorted(doc_starts, starts, side="right") - 1
    last_doc = np.searchsorted(doc_starts, starts + length - 1, side="right") - 1
    # The starts of documents 2.. of each window, as (row, offset in the window) pairs.
    counts = last_doc - first_doc
    rows = np.repeat(np.arange(len(starts)), counts)
    entries = np.repeat(first_doc + 1 - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    offsets = np.asarray(doc_starts[entries]) - starts[rows]
    is_start = np.zeros((len(starts), length), bool)
    is_start[rows, offsets] = True
    segment_ids = (1 + np.cumsum(is_start, axis=1)).astype(np.int32)
    index = np.arange(length)
    positions = (index - np.maximum.accumulate(np.where(is_start, index, 0), axis=1)).astype(np.int32)
    return {"segment_ids": segment_ids, "positions": positions}


def token_splits(
    path: str, seq_len: int, packing: bool, eval_fraction: float, vocab_size: int | None
) -> tuple[TokenWindows, TokenWindows | None]:
    """The training and evaluation windows of the store at ``path`` (``data.path``); a store whose vocabulary
    is larger than the model's (``vocab_size``), or too short for one window, is a one-line DataError."""
    store = TokenStore.open(path)
    if vocab_size is not None and store.vocab_size > vocab_size:
        raise DataError(
            f"data.path={path!r} holds token ids up to {store.vocab_size - 1} (tokenizer "
            f"{store.manifest['tokenizer']['name']}, vocab {store.vocab_size}) but model.vocab_size is "
            f"{vocab_size}; set model.vocab_size to at least {store.vocab_size}"
        )
    cut = store.num_tokens - int(round(store.num_tokens * eval_fraction))
    if eval_fraction:
        document = int(np.searchsorted(store.doc_starts, cut, side="left"))
        cut = int(store.doc_starts[min(document, len(store.doc_starts) - 1)])
    train = TokenWindows(store, seq_len, packing, 0, cut)
    if not len(train):
        raise DataError(
            f"data.path={path!r} has {cut} training tokens, fewer than data.seq_len + 1 = "
            f"{seq_len + 1}; tokenize more text, lower data.seq_len or lower data.eval_fraction"
        )
    evaluation = TokenWindows(store, seq_len, packing, cut)
    return train, (evaluation if len(evaluation) else None)
