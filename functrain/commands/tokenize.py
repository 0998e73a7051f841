"""``functrain tokenize``: input documents -> a token store, on every available core, atomically.

The parent process reads the inputs in batches of documents (:mod:`functrain.text.inputs`), worker processes
parse and encode them (:mod:`functrain.text.tokenizer`, one tokenizer each) and the parent writes the results
in input order into the store (:class:`functrain.data.token_store.StoreWriter`), so the store does not depend
on the number of workers. The store appears only when every document is written.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from tqdm import tqdm

from functrain.errors import DataError, FunctrainError
from functrain.text.inputs import Batch, check_inputs, document_batches, texts_of
from functrain.text.tokenizer import TextTokenizer, TokenizerSpec, tokenizer_spec

_worker_tokenizer: TextTokenizer | None = None


def _start_worker(spec: TokenizerSpec) -> None:
    global _worker_tokenizer
    if sys.platform.startswith("linux"):  # die with the parent (a SIGKILLed job leaves no orphans)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tokenizer = TextTokenizer(spec)


def _encode_in_worker(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_tokenizer is not None, "set by _start_worker, the pool's initializer"
    return _worker_tokenizer.encode_batch(texts_of(batch))


def available_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenize_files(
    inputs: list[str],
    out: str,
    tokenizer: str | None = None,
    workers: int | None = None,
    field: str = "text",
    shard_tokens: int | None = None,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into a new store at ``out`` and return its manifest.

    Args:
      inputs: text, JSON Lines or parquet files, or HF datasets saved on disk (see :mod:`functrain.text.inputs`).
      out: the store directory to create (must not exist).
      tokenizer: a ``tokenizer.json`` or transformers tokenizer directory; None: UTF-8 bytes.
      workers: encoding processes (None: the available cores; 1: encode in this process).
      field: the JSON field / column holding the text.
      shard_tokens: tokens per shard file (None: the store's default, 2^30).
      progress: show a progress bar (None: when stderr is a terminal).

    Workers are forked: call it with ``workers > 1`` from a process that has not run JAX computations yet (as
    the ``functrain tokenize`` command is), since JAX's threads do not survive a fork.
    """
    paths = check_inputs(inputs)
    if all(path.is_file() and path.stat().st_size == 0 for path in paths):  # (a pipe is not a file: it is read)
        raise DataError(
            f"the inputs ({', '.join(map(str, inputs))}) are empty: there is no text to tokenize and "
            f"nothing was written; give files that hold text"
        )
    # Here, not with the module: functrain.data brings JAX, a second of every CLI command's start (the parser imports
    # each command's module), and tokenizing needs none of it.
    from functrain.data.token_store import DEFAULT_SHARD_TOKENS, StoreWriter

    shard_tokens = shard_tokens or DEFAULT_SHARD_TOKENS
    spec = tokenizer_spec(tokenizer)
    text_tokenizer = TextTokenizer(spec)  # loads it here first: a bad file fails before anything is written
    workers = workers or available_cores()
    # The pool forks before the progress bar starts its monitor thread (a fork copies no other thread).
    with (
        StoreWriter(out, text_tokenizer.vocab_size, text_tokenizer.describe(), shard_tokens) as writer,
        _encoder(text_tokenizer, workers) as encode,
        tqdm(desc="tokenize", unit=" docs", disable=None if progress is None else not progress) as bar,
    ):
        for tokens, lengths in encode(document_batches(paths, field)):
            writer.add(tokens, lengths)
            bar.update(len(lengths))
    return writer.manifest


@contextlib.contextmanager
def _encoder(text_tokenizer: TextTokenizer, workers: int) -> Iterator[Callable]:
    """A function from document batches to their encodings in order: in this process, or on a pool."""
    if workers == 1:
        yield lambda batches: (text_tokenizer.encode_batch(texts_of(batch)) for batch in batches)
        return
    # fork: workers start in milliseconds and inherit the imported modules.
    with multiprocessing.get_context("fork").Pool(workers, _start_worker, (text_tokenizer.spec,)) as pool:
        yield lambda batches: pool.imap(_encode_in_worker, batches)


# ------------------------------------------------------------------------------------------ the verb

HELP = "text / jsonl / parquet / HF dataset -> a token store"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="files (or saved HF datasets) to tokenize")
    parser.add_argument("out", metavar="OUT_STORE", help="the store directory to create")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or transformers tokenizer directory (default: UTF-8 bytes)"
    )
    parser.add_argument("--workers", type=int, default=None, help="encoding processes (default: all cores)")
    parser.add_argument("--field", default="text", help="JSON field / column holding the text (default: text)")
    parser.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 2^30)")


def run(args: argparse.Namespace) -> int:
    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            raise FunctrainError(f"{flag} {value} must be at least 1")
    manifest = tokenize_files(args.inputs, args.out, args.tokenizer, args.workers, args.field, args.shard_tokens)
    print(
        f"functrain: wrote {args.out}: {manifest['num_docs']} documents, {manifest['num_tokens']} tokens "
        f"({manifest['dtype']}, vocab {manifest['vocab_size']}, tokenizer {manifest['tokenizer']['name']})"
    )
    return 0
