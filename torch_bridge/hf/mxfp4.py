"""MXFP4 checkpoints (the released GPT-OSS weights): ``X_blocks`` + ``X_scales`` read as the tensor ``X``.

OCP microscaling FP4: each byte of ``X_blocks`` [..., rows, groups, 16] holds two FP4 (E2M1) values, the low
nibble first; each byte of ``X_scales`` [..., rows, groups] is an E8M0 exponent (bias 127) shared by the 32 values
of its group. Unpacked, a row holds ``groups * 32`` values, and the last two axes are swapped: GPT-OSS stores its
expert weights as ``[experts, out, in]`` rows while ``X`` is ``[experts, in, out]`` (transformers'
``integrations/mxfp4.py``, ``convert_moe_packed_tensors``). Every value is exact in bfloat16, the dtype ``X``
is read in.

:func:`unpacked_catalog` replaces each pair in a header catalog by one :class:`PackedInfo` of the unpacked
shape (a malformed pair is a one-line CheckpointError), :func:`check_shape` holds the blocks to the shape
config.json implies, and :func:`unpacked_stream` yields ``X`` in place of its parts.
"""

import dataclasses
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from functrain.errors import CheckpointError
from torch_bridge.hf.reader import TensorInfo

BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_SCALE = 32
BYTES_PER_GROUP = VALUES_PER_SCALE // 2
PACKED_DTYPE = "MXFP4"  # the catalog dtype of an unpacked pair
_UINT8 = {"U8", "uint8"}
# The sixteen E2M1 values by code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
EXPONENT_BIAS = 127


@dataclasses.dataclass(frozen=True)
class PackedInfo(TensorInfo):
    """The tensor an MXFP4 pair unpacks to (``shape``), with the two file tensors it is read from."""

    blocks: TensorInfo
    scales: TensorInfo


def unpacked_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """``[..., rows, groups, 16]`` blocks -> the ``[..., groups * 32, rows]`` tensor they hold."""
    *prefix, rows, groups, _ = blocks_shape
    return (*prefix, groups * VALUES_PER_SCALE, rows)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The blocks and scales shapes that hold a ``[..., columns, rows]`` tensor (columns a multiple of 32)."""
    *prefix, columns, rows = shape
    groups = columns // VALUES_PER_SCALE
    return (*prefix, rows, groups, BYTES_PER_GROUP), (*prefix, rows, groups)


def _pair_problem(blocks: TensorInfo, scales: TensorInfo | None) -> str | None:
    if scales is None:
        return f"has no {blocks.name.removesuffix(BLOCKS)}{SCALES} beside it"
    if blocks.dtype not in _UINT8 or scales.dtype not in _UINT8:
        return f"and its scales must be uint8 (got {blocks.dtype} and {scales.dtype})"
    if len(blocks.shape) < 3 or blocks.shape[-1] != BYTES_PER_GROUP:
        return f"has shape {list(blocks.shape)}; MXFP4 blocks end in groups of {BYTES_PER_GROUP} bytes"
    if blocks.shape[:-1] != scales.shape:
        return f"has shape {list(blocks.shape)} but its scales {list(scales.shape)} (one for each group of 16 bytes)"
    return None


def unpacked_catalog(infos: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """``infos`` with every ``X_blocks``/``X_scales`` pair replaced by one :class:`PackedInfo` named ``X``."""
    pairs = {name.removesuffix(BLOCKS): info for name, info in infos.items() if name.endswith(BLOCKS)}
    orphans = [name for name in infos if name.endswith(SCALES) and name.removesuffix(SCALES) not in pairs]
    if orphans:
        raise CheckpointError(
            f"{orphans[0]} has no {orphans[0].removesuffix(SCALES)}{BLOCKS} beside it; the MXFP4 "
            "checkpoint is incomplete, re-download it"
        )
    unpacked = {name: info for name, info in infos.items() if not name.endswith((BLOCKS, SCALES))}
    for name, blocks in pairs.items():
        scales = infos.get(name + SCALES)
        problem = _pair_problem(blocks, scales)
        if problem is not None:
            raise CheckpointError(f"MXFP4 tensor {blocks.name} {problem}; re-download or re-export the checkpoint")
        assert scales is not None  # a missing one is a problem above
        unpacked[name] = PackedInfo(name, blocks.file, unpacked_shape(blocks.shape), PACKED_DTYPE, blocks, scales)
    return unpacked


def check_shape(info: PackedInfo, expected: tuple[int, ...]) -> None:
    """A CheckpointError naming the blocks when they do not hold the ``expected`` tensor config.json implies."""
    if info.shape == tuple(expected):
        return
    if expected[-2] % VALUES_PER_SCALE:
        raise CheckpointError(
            f"{info.blocks.name}: config.json implies {info.name} of shape {list(expected)}, whose "
            f"rows of {expected[-2]} are not whole MXFP4 groups of {VALUES_PER_SCALE}; fix config.json"
        )
    raise CheckpointError(
        f"{info.blocks.name} has shape {list(info.blocks.shape)} but config.json implies "
        f"{list(packed_shapes(expected)[0])} (MXFP4 of {info.name} {list(expected)}); "
        "config.json does not describe these weights"
    )


def dequantize(blocks: np.ndarray, scales: np.ndarray, dtype: Any = ml_dtypes.bfloat16) -> np.ndarray:
    """The ``[..., groups * 32, rows]`` tensor held by ``blocks`` [..., rows, groups, 16] and ``scales``
    [..., rows, groups] (uint8), in ``dtype``; one leading index at a time so the float32 temporaries stay small."""
    rows, groups = blocks.shape[-3:-1]
    out = np.empty(unpacked_shape(blocks.shape), dtype)
    flat_blocks, flat_scales = blocks.reshape(-1, rows, groups, BYTES_PER_GROUP), scales.reshape(-1, rows, groups)
    flat_out = out.reshape(-1, groups * VALUES_PER_SCALE, rows)
    for index in range(flat_blocks.shape[0]):
        packed = flat_blocks[index]
        values = np.empty((rows, groups, VALUES_PER_SCALE), np.float32)
        values[..., 0::2] = FP4_VALUES[packed & 0x0F]  # the low nibble is the first of the pair
        values[..., 1::2] = FP4_VALUES[packed >> 4]
        values = np.ldexp(values, flat_scales[index].astype(np.int32)[..., None] - EXPONENT_BIAS)
        flat_out[index] = values.reshape(rows, groups * VALUES_PER_SCALE).T
    return out


def unpacked_stream(
    stream: Iterator[tuple[str, np.ndarray]], packed: dict[str, PackedInfo]
) -> Iterator[tuple[str, np.ndarray]]:
    """``stream``'s tensors with each pair of ``packed`` yielded as its unpacked tensor once both parts are read
    (a part waits for its other half, which may lie in another shard)."""
    parts = {info.blocks.name: name for name, info in packed.items()} | {
        info.scales.name: name for name, info in packed.items()
    }
    waiting: dict[str, np.ndarray] = {}
    for file_name, array in stream:
        name = parts.get(file_name)
        if name is None:
            yield file_name, array
            continue
        waiting[file_name] = array
        blocks, scales = packed[name].blocks.name, packed[name].scales.name
        if blocks in waiting and scales in waiting:
            yield name, dequantize(waiting.pop(blocks), waiting.pop(scales))
