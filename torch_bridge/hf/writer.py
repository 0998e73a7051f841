"""Write HF-style directories: config.json plus safetensors weights, single-file or sharded.

Everything is written into a temporary directory beside the destination and renamed into place at the
end, so a failure part way leaves the destination untouched.
"""

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy before safetensors sees it)
import numpy as np
from safetensors.numpy import save_file

from functrain.errors import CheckpointError
from torch_bridge.hf.reader import CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(size: str | int) -> int:
    """Bytes in ``size``: an int or a string like ``"5GB"``, ``"500MB"``, ``"2GiB"`` (HF's convention)."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not match or match.group(2) not in _UNITS or float(match.group(1)) <= 0:
        raise CheckpointError(f"max_shard_size {size!r} is not a size; use bytes or a string like '5GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[str]] = []
    current_bytes = 0
    for name, nbytes in sizes.items():
        if not shards or current_bytes + nbytes > max_shard_bytes:
            shards.append([])
            current_bytes = 0
        shards[-1].append(name)
        current_bytes += nbytes
    return shards


@contextlib.contextmanager
def staged_directory(out_dir: str | os.PathLike) -> Iterator[Path]:
    """A temporary directory beside ``out_dir`` that becomes ``out_dir`` if the block succeeds."""
    out = Path(out_dir).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists and is not empty; choose a new output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty, checked above
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def write_hf_dir(
    staging: Path,
    hf_config: dict[str, Any],
    names: list[str],
    sizes: dict[str, int],
    tensor: Callable[[str], np.ndarray],
    max_shard_size: str | int,
) -> None:
    """Write config.json and safetensors shards; ``tensor(name)`` builds each tensor only when its shard is written."""
    shards = plan_shards({n: sizes[n] for n in names}, parse_size(max_shard_size))
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = SAFETENSORS_FILE if len(shards) == 1 else f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        # One shard's tensors are materialised at a time, then released.
        save_file({name: tensor(name) for name in shard}, str(staging / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (staging / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
