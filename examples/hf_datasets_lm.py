"""An LM on data as the HF ecosystem gives it: a ``datasets.Dataset`` of ``input_ids``, ``attention_mask`` and
``labels`` from a ``tokenizers`` byte-level BPE tokenizer, trained here in a second on text that ships with
Python (``pydoc_data.topics``), so nothing is downloaded.

The records are padded to a fixed length; ``labels`` is ``-100`` on padding, as HF's collators write it.
``fit`` recognises the fields without configuration: the model (the registry GPT) reads ``input_ids``, the
built-in loss predicts ``labels`` shifted by one (HF's shift) and counts exactly the tokens HF's loss would.

    python examples/hf_datasets_lm.py [RUN_DIR] [MAX_STEPS]
"""

import sys

import datasets
import numpy as np
from pydoc_data.topics import topics
from tokenizers import ByteLevelBPETokenizer

import functrain

SEQ_LEN = 32
VOCAB_SIZE = 512
IGNORE_INDEX = -100  # HF's label for a token without loss


def lines(count: int = 4000) -> list[str]:
    """Non-empty lines of the Python documentation's topics, the corpus of this example."""
    text = "\n".join(topics[name] for name in sorted(topics))
    return [line.strip() for line in text.splitlines() if len(line.strip()) > 20][:count]


def train_tokenizer(corpus: list[str]) -> ByteLevelBPETokenizer:
    """A byte-level BPE tokenizer of ``VOCAB_SIZE`` ids with a ``<pad>`` token."""
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(corpus, vocab_size=VOCAB_SIZE, special_tokens=["<pad>"], show_progress=False)
    return tokenizer


def encode(tokenizer: ByteLevelBPETokenizer, corpus: list[str]) -> datasets.Dataset:
    """Records ``{"input_ids", "attention_mask", "labels"}`` of ``SEQ_LEN`` tokens, right-padded."""
    pad = tokenizer.token_to_id("<pad>")
    tokenizer.enable_padding(pad_id=pad, pad_token="<pad>", length=SEQ_LEN)
    tokenizer.enable_truncation(SEQ_LEN)
    encodings = tokenizer.encode_batch(corpus)
    input_ids = np.array([e.ids for e in encodings], np.int32)
    attention_mask = np.array([e.attention_mask for e in encodings], np.int32)
    labels = np.where(attention_mask == 1, input_ids, IGNORE_INDEX).astype(np.int32)
    return datasets.Dataset.from_dict({"input_ids": input_ids, "attention_mask": attention_mask,
                                       "labels": labels}).with_format("numpy")


def config(vocab_size: int) -> dict:
    """A small registry GPT over the tokenizer's vocabulary."""
    return {
        "run": {"dir": "runs/example_hf_lm"},
        "model": {"name": "gpt", "vocab_size": vocab_size, "max_len": SEQ_LEN, "d_model": 64, "n_layers": 2,
                  "n_heads": 4, "d_ff": 256},
        "data": {"global_batch_size": 32, "seq_len": SEQ_LEN},
        "optimizer": {"name": "adamw", "learning_rate": 3e-3},
        "train": {"max_steps": 300},
        "log": {"every_steps": 50, "progress": False},
        "eval": {"every_steps": 100, "max_batches": 5},
    }


def main(run_dir: str = "runs/example_hf_lm", max_steps: int = 300, **overrides) -> functrain.FitResult:
    corpus = lines()
    tokenizer = train_tokenizer(corpus)
    records = encode(tokenizer, corpus)
    cut = len(records) - 256
    return functrain.fit(config(tokenizer.get_vocab_size()), train_data=records.select(range(cut)),
                         eval_data=records.select(range(cut, len(records))),
                         **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"{result.stop_reason} at step {result.step}: {result.metrics}")
