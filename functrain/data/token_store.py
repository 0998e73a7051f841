"""A token store on disk: what ``functrain tokenize`` writes and ``data.name: tokens`` reads.

Layout of a store directory::

    manifest.json        format and version, tokenizer (name, xxh64 of its file, EOS id), vocab size, dtype,
                         document and token counts, and per-file sizes and xxh64 checksums
    tokens-00000.bin     the token stream, flat little-endian uint16 (vocab <= 65536) or uint32, cut into
    tokens-00001.bin     shards of at most ``shard_tokens`` tokens (the stream continues across shards)
    docs.npy             int64 document start offsets into the stream, ``num_docs + 1`` long (last: num_tokens)

A store is built in ``OUT.tmp-<pid>-<random>`` and renamed to ``OUT`` only once the manifest is written, so a
job that dies half-way leaves a ``.tmp-`` directory that never opens as a store. Reading memory-maps every file:
a batch touches only its own bytes.
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from functrain.errors import DataError

FORMAT = "functrain-token-store"
VERSION = 1
MANIFEST = "manifest.json"
DOC_INDEX = "docs.npy"
MANIFEST_KEYS = ("tokenizer", "vocab_size", "dtype", "num_docs", "num_tokens", "shards", "doc_index")
DEFAULT_SHARD_TOKENS = 1 << 30  # 2 GiB shards at uint16: large enough to be few, small enough to copy


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a vocabulary."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def _file_digest(path: Path) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


class StoreWriter:
    """Writes documents' tokens into a new store, atomically.

    ``with StoreWriter(out, vocab_size, tokenizer_info) as writer: writer.add(tokens, lengths)``; the
    store appears at ``out`` when the block exits cleanly (``writer.manifest`` then holds its manifest), and
    nothing does if it raises or the process dies.
    """

    def __init__(
        self,
        out: str | os.PathLike,
        vocab_size: int,
        tokenizer: dict[str, Any],
        shard_tokens: int = DEFAULT_SHARD_TOKENS,
    ) -> None:
        self.out = Path(out)
        if self.out.exists():
            raise DataError(f"{str(self.out)!r} already exists; remove it or choose another output path")
        self.vocab_size, self.tokenizer, self.shard_tokens = vocab_size, tokenizer, shard_tokens
        self.dtype = token_dtype(vocab_size)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{self.out.name}.tmp-{os.getpid()}-", dir=self.out.parent))
        self.doc_lengths: list[np.ndarray] = []
        self.shards: list[dict[str, Any]] = []
        self._handle: Any = None
        self._digest = xxhash.xxh64()
        self._in_shard = 0

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents to the stream: their tokens end to end and each one's token count."""
        self.doc_lengths.append(np.asarray(lengths, np.int64))
        stream = np.asarray(tokens).astype(self.dtype, copy=False)
        while len(stream):
            if self._handle is None or self._in_shard == self.shard_tokens:
                self._open_shard()
            part, stream = np.split(stream, [self.shard_tokens - self._in_shard])
            data = part.tobytes()
            self._handle.write(data)
            self._digest.update(data)
            self._in_shard += len(part)

    def _open_shard(self) -> None:
        self._close_shard()
        name = f"tokens-{len(self.shards):05d}.bin"
        self.shards.append({"file": name})
        self._handle = open(self.tmp / name, "wb")  # noqa: SIM115 -- held across writes; _close_shard closes it
        self._digest, self._in_shard = xxhash.xxh64(), 0

    def _close_shard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self.shards[-1].update(tokens=self._in_shard, xxh64=self._digest.hexdigest())
            self._handle = None

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            if self._handle is not None:
                self._handle.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        self._close_shard()
        lengths = np.concatenate(self.doc_lengths) if self.doc_lengths else np.empty(0, np.int64)
        starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        np.save(self.tmp / DOC_INDEX, starts)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "tokenizer": self.tokenizer,
            "vocab_size": self.vocab_size,
            "dtype": self.dtype.name,
            "num_docs": len(lengths),
            "num_tokens": int(starts[-1]),
            "shards": self.shards,
            "doc_index": {"file": DOC_INDEX, "xxh64": _file_digest(self.tmp / DOC_INDEX)},
        }
        # The manifest is written last and the directory renamed after it: a store that has one is whole.
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)  # mkdtemp's private 0700, made an ordinary directory
        os.replace(self.tmp, self.out)
        self.manifest = manifest


def _map_for_random_reads(path: Path, dtype: np.dtype | None = None) -> np.ndarray:
    """A read-only memory map of a shard (or of an ``.npy`` file when ``dtype`` is None), without readahead:
    training reads a few KB at random offsets, and the kernel's default readahead (128 KB and more per page
    fault) made those reads 300x slower."""
    with open(path, "rb") as handle:
        offset, count = 0, -1
        if dtype is None:
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(handle)
            offset, count = handle.tell(), int(np.prod(shape))
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype, count=count, offset=offset)


@dataclass(frozen=True)
class TokenStore:
    """A store opened for reading: the manifest, memmaps of its shards and its document index.

    Use :meth:`open`; :meth:`read` returns any span of the stream, :attr:`doc_starts` the document offsets.
    """

    path: Path
    manifest: dict[str, Any]
    shards: tuple[np.ndarray, ...]  # read-only memory maps
    shard_starts: np.ndarray  # stream offset of each shard, plus the total at the end
    doc_starts: np.ndarray  # memory map of num_docs + 1 offsets

    @classmethod
    def open(cls, path: str | os.PathLike, key: str = "data.path") -> TokenStore:
        """Open and check a store (sizes against the manifest; no file is read whole). A missing or damaged
        store raises a one-line DataError naming ``key`` and the file."""
        path = Path(path)
        rerun = "rerun functrain tokenize to rebuild it"
        manifest_path = path / MANIFEST
        if not path.is_dir():
            raise DataError(
                f"{key}={str(path)!r} is not a directory; point it at a token store written by functrain tokenize"
            )
        if not manifest_path.is_file():
            raise DataError(
                f"{key}={str(path)!r} has no {MANIFEST}: it is not a token store or its tokenize job "
                f"did not finish; {rerun}"
            )
        try:
            manifest = json.loads(manifest_path.read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{manifest_path} is not readable JSON ({exc}); {rerun}") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise DataError(f"{manifest_path} is not a {FORMAT} manifest of version {VERSION}; {rerun}")
        missing = sorted(set(MANIFEST_KEYS) - set(manifest))
        if missing:
            raise DataError(f"{manifest_path} lacks {', '.join(missing)}; {rerun}")
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        shards = []
        for shard in manifest["shards"]:
            shard_path = path / shard["file"]
            expected = shard["tokens"] * dtype.itemsize
            size = shard_path.stat().st_size if shard_path.is_file() else None
            if size != expected:
                found = "is missing" if size is None else f"has {size} bytes"
                raise DataError(
                    f"token store shard {shard_path} {found}, the manifest says {expected} bytes: the "
                    f"store is damaged; {rerun}"
                )
            shards.append(_map_for_random_reads(shard_path, dtype))
        index_path = path / manifest["doc_index"]["file"]
        try:
            doc_starts = _map_for_random_reads(index_path)
        except (OSError, ValueError) as exc:
            raise DataError(f"token store index {index_path} does not load ({exc}); {rerun}") from None
        if doc_starts.shape != (manifest["num_docs"] + 1,) or doc_starts[-1] != manifest["num_tokens"]:
            raise DataError(
                f"token store index {index_path} does not match the manifest ({len(doc_starts)} "
                f"entries for {manifest['num_docs']} documents); {rerun}"
            )
        lengths = np.array([shard["tokens"] for shard in manifest["shards"]], np.int64)
        return cls(path, manifest, tuple(shards), np.concatenate([[0], np.cumsum(lengths)]), doc_starts)

    @property
    def num_tokens(self) -> int:
        """Tokens in the stream."""
        return int(self.manifest["num_tokens"])

    @property
    def vocab_size(self) -> int:
        """The tokenizer's vocabulary size (every id is below it)."""
        return int(self.manifest["vocab_size"])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Spans ``[start, start + length)`` of the stream as int32 ``[len(starts), length]``, one fancy-index
        read per shard (a span crossing a shard boundary is read in two parts)."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), length), np.int32)
        offsets = np.arange(length, dtype=np.int64)
        first_shard = np.searchsorted(self.shard_starts, starts, side="right") - 1
        last_shard = np.searchsorted(self.shard_starts, starts + length - 1, side="right") - 1
        for shard in np.unique(first_shard):
            rows = np.flatnonzero((first_shard == shard) & (last_shard == shard))
            if len(rows):
                local = starts[rows, None] - self.shard_starts[shard] + offsets
                out[rows] = self.shards[shard][local]
        for row in np.flatnonzero(first_shard != last_shard):
            out[row] = np.concatenate(
                [
                    self.shards[s][
                        max(starts[row] - self.shard_starts[s], 0) : starts[row] + length - self.shard_starts[s]
                    ]
                    for s in range(first_shard[row], last_shard[row] + 1)
                ]
            )
        return out
