"""Local checkpoints: each process's own shards of the train state, saved often to fast local storage.

Persistent checkpoints go to shared storage and are written rarely; a local checkpoint (``checkpoint.local_dir``,
every ``checkpoint.local_every_steps``) holds only what this process has on its devices, on its own disk or
``/dev/shm``, so it is quick to write and a crash costs the steps since it rather than since the last
persistent step. Layout::

    LOCAL_DIR/<run dir name>-<hash of its path>/process_<i>/<step>/shards.bin      every shard's bytes, one file
                                                          /<step>/manifest.json   where each shard lies, its
                                                                                   checksum, the step's meta

A save copies the shards to host memory (the next call donates the state) and writes them in a background
thread into ``<step>.tmp-<pid>/`` with each shard's checksum (xxh3, of the bytes in memory) in the manifest,
then renames the directory to ``<step>``: a step is whole or absent. Nothing is synced to the device: a local
step guards against a process's death (the page cache outlives it), and a machine that crashes loses its local
disk's newest writes, or its ``/dev/shm`` altogether; what a crash left half-written fails its checksums and is
passed over. The newest ``keep`` steps stay. A directory that cannot be written (permissions, a full disk) costs
one warning; local saves stop for the run and the persistent checkpoints carry on.

Which step a restart restores, and the transfer from a peer for a process whose copy is gone, are in
:mod:`functrain.checkpoint.local_restore`.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

log = logging.getLogger("functrain.checkpoint")

MANIFEST, DATA = "manifest.json", "shards.bin"

# A shard's place in its array: (start, stop) per dimension.
Index = tuple[tuple[int, int], ...]


# Copies, writes and hashes of shards, several at once.
_POOL = concurrent.futures.ThreadPoolExecutor(
    max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="functrain-local"
)


def _digest(data: Any) -> str:
    """xxh3-64 of a buffer (it releases the GIL: the training thread runs on while a save hashes)."""
    return xxhash.xxh3_64_hexdigest(data)


def run_key(run_dir: str | os.PathLike) -> str:
    """The folder of a run under ``checkpoint.local_dir``: runs sharing a local disk never mix."""
    path = Path(run_dir).absolute()
    return f"{path.name}-{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"


def normalized(index: tuple[slice, ...], shape: tuple[int, ...]) -> Index:
    """A shard's index as (start, stop) pairs (a full dimension's ``slice(None)`` included)."""
    return tuple(part.indices(size)[:2] for part, size in zip(index, shape))


def _shards(leaf: Any) -> dict[Index, Any]:
    """The distinct shards of ``leaf`` this process holds (an array replicated on its devices counts once)."""
    if not isinstance(leaf, jax.Array):
        array = np.asarray(leaf)
        return {tuple((0, size) for size in array.shape): array}
    found: dict[Index, Any] = {}
    for shard in leaf.addressable_shards:
        found.setdefault(normalized(shard.index, leaf.shape), shard.data)
    return found


@dataclass(frozen=True)
class LocalStep:
    """A whole local step of this process: its manifest and where its data file is."""

    step: int
    path: Path
    manifest: dict[str, Any]

    def verified(self) -> bool:
        """Whether the data file is there and every shard in it matches its checksum (one warning when not)."""
        try:
            with open(self.path / DATA, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
                with memoryview(mapped) as view:
                    whole = all(
                        _digest(view[entry["offset"] : entry["offset"] + entry["bytes"]]) == entry["checksum"]
                        for entry in self.manifest["shards"]
                    )
            if whole:
                return True
            problem = "checksum mismatch"
        except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
            problem = getattr(error, "strerror", None) or str(error)
        log.warning("functrain: warning: local checkpoint %s is damaged (%s); not restored", self.path, problem)
        return False

    def read(self) -> dict[tuple[int, Index], np.ndarray]:
        """Every shard of the step: ``{(leaf number, index): array}`` (see :meth:`verified`)."""
        leaves, raw = self.manifest["leaves"], (self.path / DATA).read_bytes()
        shards = {}
        for entry in self.manifest["shards"]:
            leaf = leaves[entry["leaf"]]
            index = tuple(tuple(pair) for pair in entry["index"])
            array = np.frombuffer(
                raw, jnp.dtype(leaf["dtype"]), count=int(np.prod([b - a for a, b in index])), offset=entry["offset"]
            )
            shards[(entry["leaf"], index)] = array.reshape([b - a for a, b in index])
        return shards


class LocalCheckpoints:
    """This process's local checkpoints of one run (see the module).

    Args:
      local_dir: ``checkpoint.local_dir``.
      run_dir: the run's (persistent) directory; names the run's folder under ``local_dir``.
      keep: local steps kept (1 or 2).
      history: when the run directory's current line of history began (its newest fresh start or rewind), or
        None before it has one: a local step of another line (the directory deleted and started again, or rewound)
        is never restored.
    """

    def __init__(
        self,
        local_dir: str | os.PathLike,
        run_dir: str | os.PathLike,
        keep: int,
        history: Callable[[], float | None],
    ):
        self.directory = Path(local_dir).absolute() / run_key(run_dir) / f"process_{jax.process_index()}"
        self.keep, self._history = keep, history
        self._history_started: float | None = None
        self._writer: threading.Thread | None = None
        self._failure: str | None = None
        self.enabled = True
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for leftover in self.directory.glob("*.tmp-*"):  # a write a crash cut short
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError as error:
            self._disable(f"{self.directory} cannot be created ({error.strerror or error})")

    def steps(self) -> list[LocalStep]:
        """Whole local steps of this run's line of history, newest first (a step of another line is left out)."""
        history, found = self._history(), []
        for path in self.directory.glob("[0-9]*") if self.enabled and history is not None else ():
            try:
                manifest = json.loads((path / MANIFEST).read_text())
            except (OSError, ValueError):
                continue
            if path.name.isdigit() and manifest.get("history_started") == history:
                found.append(LocalStep(int(path.name), path, manifest))
        return sorted(found, key=lambda local: -local.step)

    def save(self, step: int, items: Any, meta: dict[str, Any]) -> None:
        """Copy this process's shards of ``items`` to host memory and write them as ``step`` in the background."""
        self.wait()
        if not self.enabled:
            return
        if self._history_started is None:  # saves come after the session's start is recorded: read it once
            self._history_started = self._history()
        leaves = jax.tree.leaves(items)
        placed = [(number, index, data) for number, leaf in enumerate(leaves) for index, data in _shards(leaf).items()]
        # Copies (the next call donates the device buffers), several at once: numpy copies without the GIL.
        copies = _POOL.map(lambda shard: np.array(shard[2], copy=True), placed)
        shards = [(number, index, copy) for (number, index, _), copy in zip(placed, copies)]
        described = [{"shape": list(np.shape(leaf)), "dtype": str(leaf.dtype)} for leaf in leaves]
        self._writer = threading.Thread(
            target=self._write, args=(step, shards, described, meta), name="functrain-local-save", daemon=True
        )
        self._writer.start()

    def wait(self) -> None:
        """Wait for the write in flight; a failed one turns local saves off with one warning."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._failure is not None:
            self._disable(self._failure)
            self._failure = None

    def _disable(self, reason: str) -> None:
        if self.enabled:
            log.warning(
                "functrain: warning: local checkpoint not written: %s; local checkpoints are off for this run, "
                "persistent checkpoints carry on",
                reason,
            )
        self.enabled = False

    def _write(self, step: int, shards: list, leaves: list[dict], meta: dict[str, Any]) -> None:
        tmp = self.directory / f"{step}.tmp-{os.getpid()}"
        try:
            tmp.mkdir(parents=True)
            raws = [np.ascontiguousarray(array).reshape(-1).view(np.uint8) for _, _, array in shards]
            offsets = np.concatenate([[0], np.cumsum([raw.nbytes for raw in raws])]).tolist()
            descriptor = os.open(tmp / DATA, os.O_WRONLY | os.O_CREAT, 0o644)
            try:

                def put(number: int) -> str:
                    os.pwrite(descriptor, raws[number].data, offsets[number])
                    return _digest(raws[number])  # of the bytes in memory: no second read of the file

                digests = list(_POOL.map(put, range(len(raws))))  # os.pwrite and xxhash run without the GIL
            finally:
                os.close(descriptor)
            entries = [
                {
                    "leaf": number,
                    "index": [list(pair) for pair in index],
                    "offset": offset,
                    "bytes": raw.nbytes,
                    "checksum": digest,
                }
                for (number, index, _), raw, offset, digest in zip(shards, raws, offsets, digests)
            ]
            manifest = {
                "step": step,
                "history_started": self._history_started,
                "leaves": leaves,
                "shards": entries,
                "algorithm": "xxh3_64 of each shard",
                "meta": meta,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            target = self.directory / str(step)
            if target.exists():  # the same step again (a resumed history): the new one replaces it
                shutil.rmtree(target)
            os.rename(tmp, target)  # the commit
            for old in self.steps()[self.keep :]:
                shutil.rmtree(old.path, ignore_errors=True)
        except OSError as error:
            shutil.rmtree(tmp, ignore_errors=True)
            self._failure = f"step {step} in {self.directory} ({error.strerror or error})"
