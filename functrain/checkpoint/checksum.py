"""Checksums of the bytes each process writes into a checkpoint item, checked when the item is read.

Orbax stores no checksum: an array file zeroed or flipped in place restores as wrong numbers. So every
process hashes the array data files it wrote itself (``<item>/ocdbt.process_<i>/...``, one or more per
array) as soon as its writes have finished, in Orbax's background commit (off the training thread, and of
the bytes on disk, not of a copy), and records them in ``<item>/checksums.process_<i>.json`` before the
step is committed. The step's meta records the algorithm and how many processes wrote, so a missing record
is damage as well. xxh3-64 hashes at ~10 GB/s on one core, about 7x sha256 here, and a file's blocks are
hashed on several cores at once.
"""

from __future__ import annotations

import concurrent.futures
import json
import mmap
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import xxhash

ALGORITHM = "xxh3_64 of 32 MiB blocks"
_BLOCK_BYTES = 32 << 20
_HASH_POOL = concurrent.futures.ThreadPoolExecutor(
    max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="functrain-hash"
)
_RECORD_PREFIX = "checksums.process_"
_DATA_PREFIX = "ocdbt.process_"


def file_checksum(path: Path) -> str:
    """The checksum of a file: xxh3-64 over the xxh3-64 digests of its 32 MiB blocks.

    Blocks are hashed in parallel (xxhash releases the GIL) straight from the mapped file, so hashing a
    checkpoint takes about its size over the memory bandwidth of the free cores. Each block's pages leave the
    process's resident set once hashed (they stay in the page cache), so hashing a file just written beside
    the params it holds does not add the file's size to peak RSS (see bench/bench_hf_convert.py).
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped, memoryview(mapped) as view:

            def block_digest(start: int) -> bytes:
                with view[start : start + _BLOCK_BYTES] as block:  # released: the mapping cannot close under views
                    digest = xxhash.xxh3_64_digest(block)
                mapped.madvise(mmap.MADV_DONTNEED, start, min(_BLOCK_BYTES, size - start))
                return digest

            digests = list(_HASH_POOL.map(block_digest, range(0, size, _BLOCK_BYTES)))
    return xxhash.xxh3_64_hexdigest(b"".join(digests))


def _data_files(item_dir: Path, process_index: int) -> list[str]:
    """Files process ``process_index`` wrote under ``item_dir`` (relative, sorted)."""
    root = item_dir / f"{_DATA_PREFIX}{process_index}"
    return sorted(str(p.relative_to(item_dir)) for p in root.rglob("*") if p.is_file())


def record(item_dir: Path, process_index: int) -> None:
    """Hash the data files this process wrote and record them beside them (before the step commits)."""
    sums = {name: file_checksum(item_dir / name) for name in _data_files(item_dir, process_index)}
    record_file = item_dir / f"{_RECORD_PREFIX}{process_index}.json"
    record_file.write_text(json.dumps({"algorithm": ALGORITHM, "files": sums}, indent=1, sort_keys=True))


class RecordAfterWrites:
    """An Orbax commit future: waits for an item's writes, then records their checksums (in its own thread)."""

    # One thread per item (params, state) hashing at once; xxhash releases the GIL.
    _pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="functrain-checksum")

    def __init__(self, writes: Sequence[Any], item_dir: Path, process_index: int):
        self._future = self._pool.submit(self._run, list(writes), Path(item_dir), process_index)

    @staticmethod
    def _run(writes: list[Any], item_dir: Path, process_index: int) -> None:
        for write in writes:
            write.result()
        record(item_dir, process_index)

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checksums are on disk; re-raise a failed write or a failed record."""
        self._future.result(timeout)

    def cancel(self) -> None:
        """Orbax cancels pending commits when a save is abandoned."""
        self._future.cancel()


def meta_record(process_count: int) -> dict[str, Any]:
    """What a step's meta says about its checksums."""
    return {"algorithm": ALGORITHM, "processes": int(process_count)}


def verify(item_dir: Path, recorded: Mapping[str, Any], process_index: int = 0, process_count: int = 1) -> str | None:
    """The first problem with an item's data files against its records, or ``None`` when all match.

    ``recorded`` is the meta's checksum record; this process checks the records of the writer processes
    ``p`` with ``p % process_count == process_index``, so a multi-process restore reads every file once.
    """
    if recorded.get("algorithm") != ALGORITHM:
        return f"checksums by unknown algorithm {recorded.get('algorithm')!r}"
    for writer in range(process_index, int(recorded.get("processes", 1)), process_count):
        record_file = item_dir / f"{_RECORD_PREFIX}{writer}.json"
        try:
            sums = json.loads(record_file.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError):
            return f"missing or unreadable {item_dir.name}/{record_file.name}"
        on_disk = _data_files(item_dir, writer)
        missing, unexpected = sorted(set(sums) - set(on_disk)), sorted(set(on_disk) - set(sums))
        if missing:
            return f"{item_dir.name}/{missing[0]} is missing (written by process {writer})"
        if unexpected:
            return f"{item_dir.name}/{unexpected[0]} was not written by the save (no checksum recorded for it)"
        for name, expected in sums.items():
            if file_checksum(item_dir / name) != expected:
                return f"checksum mismatch in {item_dir.name}/{name} (written by process {writer})"
    return None
