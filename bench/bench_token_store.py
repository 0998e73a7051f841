"""Token stores (issue 11): resume cost, loader throughput per host, and ``functrain tokenize`` throughput.

1. Resume on a 10^10-token store (ten sparse 2^30-token shards plus a synthetic index of 10^7 documents):
   time from "open the store and resume at position p" to the first packed batch in hand, at the start, the
   middle and the end of the stream (target: flat, under 10 ms).
2. Loader throughput of one host of 8 slicing the global batch (packed windows) against the tokens/s the char
   GPT of ``configs/char_gpt.yaml`` trains on this CPU, measured here (target >= 20x).
3. ``functrain tokenize`` (read jsonl, encode on every core, write the store) against the HF ``tokenizers``
   batch encoder alone on the same documents in memory (target >= 0.8x).

    python bench/bench_token_store.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loop import LogClock  # noqa: E402

from functrain import fit  # noqa: E402
from functrain.data import BatchLoader, IndexSampler  # noqa: E402
from functrain.data.token_store import DOC_INDEX, FORMAT, MANIFEST, VERSION  # noqa: E402
from functrain.data.token_windows import token_splits  # noqa: E402
from functrain.data.datasets import bundled_text  # noqa: E402
from functrain.commands.tokenize import available_cores, tokenize_files  # noqa: E402

NUM_TOKENS = 10**10
SHARD_TOKENS = 1 << 30
SEQ_LEN = 1024
HOSTS = 8
GLOBAL_BATCH = 256


def sparse_store(directory: Path) -> Path:
    """A 10^10-token uint16 store whose shards are sparse files and whose documents are ~1000 tokens."""
    store = directory / "store"
    store.mkdir()
    shards = []
    for number, first in enumerate(range(0, NUM_TOKENS, SHARD_TOKENS)):
        tokens = min(SHARD_TOKENS, NUM_TOKENS - first)
        name = f"tokens-{number:05d}.bin"
        with open(store / name, "wb") as handle:
            handle.truncate(tokens * 2)
        shards.append({"file": name, "tokens": tokens, "xxh64": None})
    num_docs = NUM_TOKENS // 1000
    starts = np.lib.format.open_memmap(store / DOC_INDEX, mode="w+", dtype=np.int64, shape=(num_docs + 1,))
    jitter = np.random.default_rng(0).integers(0, 500, num_docs)
    starts[:num_docs] = np.arange(num_docs, dtype=np.int64) * 1000 + jitter
    starts[0], starts[num_docs] = 0, NUM_TOKENS
    starts.flush()
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": {"name": "synthetic", "xxh64": None,
                                                                    "eos_id": None},
                "vocab_size": 256, "dtype": "uint16", "num_docs": num_docs, "num_tokens": NUM_TOKENS,
                "shards": shards, "doc_index": {"file": DOC_INDEX, "xxh64": None}}
    (store / MANIFEST).write_text(json.dumps(manifest))
    return store


def resume_ms(store: Path, fraction: float, repeat: int) -> float:
    """Milliseconds from opening the store to the first packed host batch near ``fraction`` of the stream
    (each ``repeat`` a different batch, so no read is served by an earlier one's pages)."""
    start = time.perf_counter()
    train, _ = token_splits(str(store), SEQ_LEN, True, 0.0, 256)
    sampler = IndexSampler(len(train), GLOBAL_BATCH, seed=0)
    batch_number = int(fraction * (len(train) // GLOBAL_BATCH - 1)) + repeat * (1 - 2 * (fraction > 0.5))
    position = batch_number * GLOBAL_BATCH
    loader = BatchLoader(train, sampler, process_index=3, process_count=HOSTS, prefetch=0)
    batch, _ = loader.host_batch(position)
    assert batch["tokens"].shape == (GLOBAL_BATCH // HOSTS, SEQ_LEN + 1)
    return (time.perf_counter() - start) * 1e3


def loader_tokens_per_sec(store: Path, batches: int = 200) -> float:
    """Training tokens/s one host of 8 assembles (packed windows, random positions in the stream)."""
    train, _ = token_splits(str(store), SEQ_LEN, True, 0.0, 256)
    loader = BatchLoader(train, IndexSampler(len(train), GLOBAL_BATCH, seed=0), process_index=5,
                         process_count=HOSTS, prefetch=0)
    position = 0
    start = time.perf_counter()
    for _ in range(batches):
        _, position = loader.host_batch(position)
    return batches * (GLOBAL_BATCH // HOSTS) * SEQ_LEN / (time.perf_counter() - start)


def char_gpt_tokens_per_sec(steps: int = 60, warmup: int = 20) -> float:
    """Tokens/s ``configs/char_gpt.yaml`` trains on this machine (timed between two logged steps)."""
    clock = LogClock(warmup, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        fit("configs/char_gpt.yaml", callbacks=[clock], **{
            "run.dir": run_dir, "train.max_steps": steps, "log.every_steps": 10, "checkpoint.every_steps": 0,
            "eval.every_steps": 0, "data.eval_fraction": 0.0, "log.tensorboard": False, "log.progress": False,
            "log.plot": False, "eval.samples.count": 0, "optimizer.warmup_steps": 0})
    return clock.steps_per_sec() * 32 * 64


def tokenize_ratio(directory: Path, repeats: int = 3) -> tuple[float, float, float]:
    """(functrain tokenize MB/s, tokenizers encode_batch_fast MB/s, byte-fallback MB/s) on ~8 MB of text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    documents = [paragraph for paragraph in bundled_text().split("\n\n") if paragraph.strip()] * 10
    megabytes = sum(len(doc.encode()) for doc in documents) / 1e6
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(documents[: len(documents) // 10], trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    with open(directory / "docs.jsonl", "w") as lines:
        for doc in documents:
            lines.write(json.dumps({"text": doc}) + "\n")
    ours, alone, byte_rates = [], [], []
    for repeat in range(repeats):
        start = time.perf_counter()
        tokenizer.encode_batch_fast(documents)
        alone.append(megabytes / (time.perf_counter() - start))
        start = time.perf_counter()
        tokenize_files([str(directory / "docs.jsonl")], str(directory / f"bpe{repeat}"),
                       str(directory / "tokenizer.json"), progress=False)
        ours.append(megabytes / (time.perf_counter() - start))
        start = time.perf_counter()
        tokenize_files([str(directory / "docs.jsonl")], str(directory / f"bytes{repeat}"), progress=False)
        byte_rates.append(megabytes / (time.perf_counter() - start))
    return statistics.median(ours), statistics.median(alone), statistics.median(byte_rates)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        # Tokenize first: its worker processes fork, which JAX (started by the char GPT run) does not survive.
        ours, alone, byte_rate = tokenize_ratio(directory)
        print(f"tokenize ({available_cores()} workers, jsonl -> store): {ours:.2f} MB/s vs tokenizers "
              f"encode_batch_fast alone {alone:.2f} MB/s: {ours / alone:.2f}x (target >= 0.8x); byte fallback "
              f"{byte_rate:.1f} MB/s")

        store = sparse_store(directory)
        fractions = {"start": 0.0, "middle": 0.5, "end": 1.0}
        resume_ms(store, 0.25, 0)  # the first call pays for numpy's and the sampler's first-use costs
        samples: dict[str, list[float]] = {name: [] for name in fractions}
        for repeat in range(9):  # interleaved, so that a busy moment of the machine hits every position alike
            for name, fraction in fractions.items():
                samples[name].append(resume_ms(store, fraction, repeat))
        times = {name: statistics.median(values) for name, values in samples.items()}
        print(f"resume to the first packed batch on a 10^10-token store ({GLOBAL_BATCH // HOSTS} x {SEQ_LEN + 1} "
              f"tokens, host 3 of {HOSTS}): " + ", ".join(f"{name} {ms:.2f} ms" for name, ms in times.items()) +
              f"; slowest/fastest {max(times.values()) / min(times.values()):.2f}x (target: flat, < 10 ms)")

        loader_rate = loader_tokens_per_sec(store)
        gpt_rate = char_gpt_tokens_per_sec()
        print(f"loader, one host of {HOSTS}: {loader_rate / 1e6:.1f} M tokens/s vs char GPT training "
              f"{gpt_rate / 1e3:.1f} k tokens/s: {loader_rate / gpt_rate:.0f}x (target >= 20x)")


if __name__ == "__main__":
    main()
