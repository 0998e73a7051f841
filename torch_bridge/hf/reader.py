"""Read HF-style model directories: config.json plus safetensors or pytorch ``.bin`` weights, single or sharded.

`catalog` reads only headers (names, shapes, dtypes) so a bad directory fails before any tensor data is
read; `stream` then yields one tensor at a time, one shard at a time. bf16 stays bf16: numpy arrays use
``ml_dtypes.bfloat16`` and torch tensors are reinterpreted bit for bit, never converted through float32.
"""

import dataclasses
import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator

import ml_dtypes  # registers bfloat16 with numpy; must precede safetensors' numpy loading of BF16
import numpy as np
from safetensors import safe_open

from functrain.errors import CheckpointError

# safetensors' numpy backend has no float8 dtypes (FP8 checkpoints): those tensors are read from the file's bytes.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
CONFIG_FILE = "config.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN_FILE, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it looks like, from the file header alone."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class WeightFiles:
    """The weight files of an HF directory, in shard order, and their format."""

    format: str  # "safetensors" | "bin"
    files: tuple[Path, ...]
    index: dict[str, str] | None  # the sharded index's weight_map, if any


def read_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of ``hf_dir``."""
    path = Path(hf_dir) / CONFIG_FILE
    if not Path(hf_dir).is_dir():
        what = "is a file" if Path(hf_dir).exists() else "does not exist"
        raise CheckpointError(f"{hf_dir} {what}; pass an HF model directory (config.json next to its weights)")
    if not path.is_file():
        raise CheckpointError(f"{path} not found; an HF model directory needs config.json next to its weights")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); restore the file from its source") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object; restore the file from its source")
    return config


def find_weights(hf_dir: str | os.PathLike) -> WeightFiles:
    """Locate the weights: a sharded index or a single file, safetensors preferred over ``.bin``."""
    root = Path(hf_dir)
    for fmt, index_name, single_name in (
        ("safetensors", SAFETENSORS_INDEX, SAFETENSORS_FILE),
        ("bin", BIN_INDEX, BIN_FILE),
    ):
        if (root / index_name).is_file():
            weight_map = _read_index(root / index_name)
            files = tuple(root / name for name in dict.fromkeys(weight_map.values()))
            for file in files:
                if not file.is_file():
                    raise CheckpointError(
                        f"{root / index_name} names {file.name}, which does not exist; "
                        f"copy the missing shard into {root}"
                    )
            return WeightFiles(fmt, files, weight_map)
        if (root / single_name).is_file():
            return WeightFiles(fmt, (root / single_name,), None)
    raise CheckpointError(
        f"no weights in {root}: expected {SAFETENSORS_FILE}, {SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX}"
    )


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise CheckpointError(
            f"{path} is not a valid index (needs a JSON 'weight_map'); restore it from its source"
        ) from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{path}: 'weight_map' must map tensor names to file names")
    return weight_map


def catalog(weights: WeightFiles) -> dict[str, TensorInfo]:
    """Every tensor's name, file, shape and dtype, read from headers only; checks the index agrees."""
    infos: dict[str, TensorInfo] = {}
    for file in weights.files:
        for name, shape, dtype in _header(file, weights.format):
            if name in infos:
                raise CheckpointError(
                    f"tensor {name} appears in both {infos[name].file.name} and {file.name}; remove the duplicate shard"
                )
            infos[name] = TensorInfo(name, file, shape, dtype)
    if weights.index is not None:
        for name, file_name in weights.index.items():
            if name not in infos or infos[name].file.name != file_name:
                raise CheckpointError(
                    f"the index places {name} in {file_name}, but that file does not hold it; "
                    "regenerate the index or restore the shard"
                )
    return infos


def _header(file: Path, fmt: str) -> list[tuple[str, tuple[int, ...], str]]:
    if fmt == "safetensors":
        with _open_safetensors(file) as handle:
            entries = []
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                entries.append((name, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()))
            return entries
    state = _load_bin(file)
    return [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in state.items()]


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="np")
    except Exception as err:  # noqa: BLE001 -- safetensors raises its own SafetensorError (and OSError) for bad files
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({reason}); re-download or re-export it"
        ) from None


def _load_bin(file: Path) -> dict[str, Any]:
    import torch  # only the .bin format needs torch

    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001 -- unpickling raises whatever the damaged file provokes
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file} is not a readable PyTorch state dict ({reason}); re-download or re-export it"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{file} does not hold a flat state dict of tensors; save model.state_dict()")
    return state


def stream(weights: WeightFiles, names: set[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (name, numpy array) one tensor at a time, shard by shard (only ``names`` if given).

    Each safetensors tensor is read through its own short-lived ``safe_open`` so the file's memory map
    never holds more than one tensor's pages; resident memory stays near the tensors kept by the caller.
    """
    for file in weights.files:
        if weights.format == "safetensors":
            with _open_safetensors(file) as handle:
                keys = [k for k in handle.keys() if names is None or k in names]
            for name in keys:
                with _open_safetensors(file) as handle:
                    tensor_slice = handle.get_slice(name)
                    raw = tensor_slice.get_dtype() in RAW_DTYPES
                    array = _raw_tensor(file, name) if raw else tensor_slice[:]
                yield name, array
        else:
            state = _load_bin(file)
            for name in [k for k in state if names is None or k in names]:
                yield name, torch_to_numpy(state.pop(name))
            del state


def _raw_tensor(file: Path, name: str) -> np.ndarray:
    """Tensor ``name`` of a safetensors ``file`` read from its bytes (the 8-byte header length, the JSON header
    with each tensor's dtype, shape and data offsets, then the data)."""
    with open(file, "rb") as handle:
        header_bytes = struct.unpack("<Q", handle.read(8))[0]
        entry = json.loads(handle.read(header_bytes))[name]
    start, end = entry["data_offsets"]
    data = np.fromfile(file, dtype=np.uint8, count=end - start, offset=8 + header_bytes + start)
    return data.view(RAW_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def torch_to_numpy(tensor: Any) -> np.ndarray:
    """A numpy copy of a CPU torch tensor; bf16 is reinterpreted bit for bit as ``ml_dtypes.bfloat16``."""
    import torch

    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        like = ml_dtypes.float8_e4m3fn if tensor.dtype == torch.float8_e4m3fn else ml_dtypes.float8_e5m2
        return tensor.view(torch.uint8).numpy().view(like).copy()
    return tensor.numpy().copy()
