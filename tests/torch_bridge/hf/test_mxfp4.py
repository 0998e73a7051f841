"""MXFP4 dequantization (the released GPT-OSS checkpoints) against transformers' own, bit for bit, and malformed
block/scale pairs refused in one line."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from functrain.errors import CheckpointError
from torch_bridge.hf import mxfp4
from torch_bridge.hf.reader import TensorInfo


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
def test_dequantization_is_transformers_bit_for_bit(dtype):
    """Every byte value and every E8M0 scale (the extremes overflow to inf or underflow, as transformers' do),
    over 3 experts of 40 rows of 2 groups of 32 values: [3, 64, 40] out, the last two axes swapped."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 2, 16), dtype=np.uint8)
    scales = np.arange(3 * 40 * 2, dtype=np.int64).reshape(3, 40, 2).astype(np.uint8)  # 0..239 and wrapped
    ours = mxfp4.dequantize(blocks, scales, np.dtype(dtype))
    torch_dtype = torch.float32 if dtype is np.float32 else torch.bfloat16
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch_dtype)
    assert ours.shape == (3, 64, 40) == tuple(theirs.shape) and ours.dtype == np.dtype(dtype)
    bits = np.int32 if dtype is np.float32 else np.int16
    assert np.array_equal(ours.view(bits), theirs.view(getattr(torch, np.dtype(bits).name)).numpy())
    # One value by hand: expert 0, value 1 of row 0 is the high nibble of its first byte times 2^(scale - 127).
    expected = mxfp4.FP4_VALUES[blocks[0, 0, 0, 0] >> 4] * 2.0 ** (int(scales[0, 0, 0]) - 127)
    assert float(ours[0, 1, 0]) == np.float32(expected)


def info(name: str, shape: tuple[int, ...], dtype: str = "U8") -> TensorInfo:
    return TensorInfo(name, Path("model.safetensors"), shape, dtype)


def test_each_pair_becomes_the_tensor_it_holds():
    infos = {
        "x.gate_up_proj_blocks": info("x.gate_up_proj_blocks", (2, 64, 1, 16)),
        "x.gate_up_proj_scales": info("x.gate_up_proj_scales", (2, 64, 1)),
        "x.gate_up_proj_bias": info("x.gate_up_proj_bias", (2, 64), "BF16"),
    }
    unpacked = mxfp4.unpacked_catalog(infos)
    assert sorted(unpacked) == ["x.gate_up_proj", "x.gate_up_proj_bias"]
    packed = unpacked["x.gate_up_proj"]
    assert isinstance(packed, mxfp4.PackedInfo) and packed.shape == (2, 32, 64)
    mxfp4.check_shape(packed, (2, 32, 64))
    with pytest.raises(CheckpointError, match=r"x\.gate_up_proj_blocks has shape \[2, 64, 1, 16\] but config\.json "
                                              r"implies \[2, 128, 2, 16\] \(MXFP4 of x\.gate_up_proj \[2, 64, 128\]\)"):
        mxfp4.check_shape(packed, (2, 64, 128))
    with pytest.raises(CheckpointError, match=r"rows of 40 are not whole MXFP4 groups of 32"):
        mxfp4.check_shape(packed, (2, 40, 64))


@pytest.mark.parametrize("blocks, scales, message", [
    ((2, 64, 1, 16), None, r"x_blocks has no x_scales beside it"),
    ((2, 64, 1, 8), (2, 64, 1), r"x_blocks has shape \[2, 64, 1, 8\]; MXFP4 blocks end in groups of 16 bytes"),
    ((2, 64, 2, 16), (2, 64, 1), r"x_blocks has shape \[2, 64, 2, 16\] but its scales \[2, 64, 1\]"),
    ((16,), (1,), r"x_blocks has shape \[16\]; MXFP4 blocks end"),
], ids=["no_scales", "half_groups", "scales_disagree", "flat"])
def test_malformed_pairs_are_refused_in_one_line(blocks, scales, message):
    infos = {"x_blocks": info("x_blocks", blocks)}
    if scales is not None:
        infos["x_scales"] = info("x_scales", scales)
    with pytest.raises(CheckpointError, match=message) as caught:
        mxfp4.unpacked_catalog(infos)
    assert "\n" not in str(caught.value)


def test_scales_without_blocks_and_blocks_of_another_dtype_are_refused():
    with pytest.raises(CheckpointError, match=r"x_scales has no x_blocks beside it"):
        mxfp4.unpacked_catalog({"x_scales": info("x_scales", (2, 64, 1))})
    with pytest.raises(CheckpointError, match=r"must be uint8 \(got F32 and U8\)"):
        mxfp4.unpacked_catalog({"x_blocks": info("x_blocks", (2, 64, 1, 16), "F32"),
                                "x_scales": info("x_scales", (2, 64, 1))})


def test_the_released_blocks_unpack_to_the_experts_transformers_declares():
    """gpt-oss-20b: 32 experts, hidden 2880, intermediate 2880; ``GptOssExperts.gate_up_proj`` is
    [E, hidden, 2 x inter] and ``down_proj`` [E, inter, hidden]."""
    assert mxfp4.unpacked_shape((32, 5760, 90, 16)) == (32, 2880, 5760)
    assert mxfp4.unpacked_shape((32, 2880, 90, 16)) == (32, 2880, 2880)
    assert mxfp4.packed_shapes((32, 2880, 5760)) == ((32, 5760, 90, 16), (32, 5760, 90))


def test_the_stream_yields_a_pair_once_both_halves_are_read():
    rng = np.random.default_rng(1)
    blocks, scales = rng.integers(0, 256, (1, 32, 1, 16), dtype=np.uint8), np.full((1, 32, 1), 127, np.uint8)
    packed = mxfp4.unpacked_catalog({"w_blocks": info("w_blocks", blocks.shape), "w_scales": info("w_scales", (1, 32, 1))})
    stream = iter([("w_scales", scales), ("other", np.zeros(2)), ("w_blocks", blocks)])  # halves split by another
    names = [name for name, _ in mxfp4.unpacked_stream(stream, {"w": packed["w"]})]
    assert names == ["other", "w"]
