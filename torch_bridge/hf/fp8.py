"""Block-quantised FP8 checkpoints (DeepSeek-V3's release), dequantised on load.

Such a directory's config.json says ``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}``;
each quantised ``<name>.weight`` is float8 (e4m3) and comes with ``<name>.weight_scale_inv``, float32
``[ceil(rows / 128), ceil(cols / 128)]``: the weight is ``float8 value * the scale of its block`` (DeepSeek's
``weight_dequant``; transformers' ``_dequantize_fp8_weight``), computed here in float32.
"""

import math
from typing import Any, Iterator

import numpy as np

from functrain.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}


def block_shape(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """The ``(rows, cols)`` of one scale block when config.json declares block-quantised FP8 weights, else None."""
    quantization = hf_config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    block = quantization.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(size, int) and size > 0 for size in block):
        raise CheckpointError(
            f"config.json: quantization_config.weight_block_size {block!r} is not two positive integers; "
            "fix config.json"
        )
    return block[0], block[1]


def scale_name(weight_name: str) -> str:
    """The name of the scales of ``weight_name`` (``x.weight`` -> ``x.weight_scale_inv``)."""
    return weight_name + SCALE_SUFFIX


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The shape of the scales of a weight of ``shape``: one per block, partial blocks at the edges included."""
    rows, cols = shape
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "weight") -> np.ndarray:
    """The float32 weight of a block-quantised ``weight`` [rows, cols] and its ``scale_inv`` (one per block)."""
    if weight.ndim != 2 or tuple(scale_inv.shape) != scale_grid(weight.shape, block):
        expected = list(scale_grid(weight.shape, block)) if weight.ndim == 2 else "a 2-D weight"
        raise CheckpointError(
            f"{name}{SCALE_SUFFIX} has shape {list(scale_inv.shape)} for a weight of shape {list(weight.shape)} in "
            f"{block[0]}x{block[1]} blocks (expected {expected}); the checkpoint's scales do not fit its weights"
        )
    out = weight.astype(np.float32)
    scales = scale_inv.astype(np.float32)
    for index, start in enumerate(range(0, out.shape[0], block[0])):  # one band of rows at a time: no second copy
        out[start : start + block[0]] *= np.repeat(scales[index], block[1])[: out.shape[1]]
    return out


def dequantized(
    tensors: Iterator[tuple[str, np.ndarray]], scales: dict[str, np.ndarray], block: tuple[int, int]
) -> Iterator[tuple[str, np.ndarray]]:
    """``tensors`` (name, array) with each weight that has scales in ``scales`` (by weight name) dequantised."""
    for name, array in tensors:
        yield name, (dequantize(array, scales[name], block, name) if name in scales else array)
