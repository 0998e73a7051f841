"""``data.name: synthetic``: random token ids, so planning, benchmarks and a first smoke run on new hardware
need no corpus.

Record ``i`` is ``seq_len + 1`` token ids in ``[0, vocab_size)``, each a hash of ``(seed, i, offset)``
(SplitMix64's finaliser): the same for any batch size, process count or gather order, and computed when a batch
is gathered, so :data:`NUM_RECORDS` records cost no memory. The last ``data.eval_fraction`` of the records
evaluate, as for the other built-in datasets. The tokens carry no signal: the loss settles at ``ln(vocab_size)``.
"""

from __future__ import annotations

import numpy as np

from functrain.errors import DataError

# 2**24 records: at 8192 tokens each, 137 billion tokens, more than any planned or benchmarked run reads.
NUM_RECORDS = 2**24

_MASK = np.uint64(2**64 - 1)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose output bits all depend on every input bit."""
    with np.errstate(over="ignore"):  # wrapping multiplication is the point
        values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (values ^ (values >> np.uint64(31))) & _MASK


class SyntheticTokens:
    """Records ``[first, first + length)`` of the synthetic stream of ``seed`` (a Source)."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int, first: int = 0, length: int = NUM_RECORDS) -> None:
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.first, self._length = first, length

    def __len__(self) -> int:
        return self._length

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """``tokens`` [len(indices), seq_len + 1] int32."""
        records = self.first + np.asarray(indices, np.uint64)
        offsets = np.arange(self.seq_len + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            keys = _mix(np.uint64(self.seed) * np.uint64(0x9E3779B97F4A7C15) + records)
            hashed = _mix(keys[:, None] + offsets[None, :] * np.uint64(0xD1B54A32D192ED03))
        return {"tokens": (hashed % np.uint64(self.vocab_size)).astype(np.int32)}


def synthetic_splits(
    seq_len: int, vocab_size: int | None, seed: int, eval_fraction: float
) -> tuple[SyntheticTokens, SyntheticTokens | None]:
    """The (train, eval or None) parts of :data:`NUM_RECORDS` synthetic records; ``vocab_size`` is the model's."""
    if not vocab_size:
        raise DataError(
            "data.name=synthetic draws token ids below model.vocab_size, which this model does not have; "
            "use a language model (model.name=gpt, llama, ...) or another data.name"
        )
    num_eval = int(round(NUM_RECORDS * eval_fraction))
    train = SyntheticTokens(seq_len, vocab_size, seed, length=NUM_RECORDS - num_eval)
    evaluation = SyntheticTokens(seq_len, vocab_size, seed, first=NUM_RECORDS - num_eval, length=num_eval)
    return train, evaluation if num_eval else None
