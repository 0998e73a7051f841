"""Quantized frozen weights against bitsandbytes 0.50's CPU path: NF4 codes, absmax and the dequantized weight bit
for bit; double quantization within the bounds functrain/models/quantized.py states; int8 as qwix quantizes; the
frozen product's gradient; the section's checks."""

import bitsandbytes.functional as bnb
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import qwix
import torch

from functrain.core.fp8 import fp8_products
from functrain.models.configs.lora import LoraConfig
from functrain.models.matmul import dense_dot_general
from functrain.models.quantized import (
    dequantize,
    dynamic_values,
    frozen_product,
    nf4_values,
    quantize_int8,
    quantize_nf4,
)

quantize = jax.jit(quantize_nf4, static_argnums=(1, 2))


def bf16_weight(shape, seed=0):
    """A bf16 weight as HF checkpoints hold them, std 0.02."""
    torch.manual_seed(seed)
    return (torch.randn(*shape) * 0.02).to(torch.bfloat16)


def codes_of(packed):
    return np.stack([packed >> 4, packed & 0xF], axis=-1).reshape(packed.shape[0], -1)


def test_tables_are_bitsandbytes_own():
    np.testing.assert_array_equal(np.asarray(nf4_values()), bnb.get_4bit_type("nf4", device="cpu").numpy())
    np.testing.assert_array_equal(dynamic_values(), bnb.create_dynamic_map(signed=True).numpy())


@pytest.mark.parametrize("shape,block", [((64, 256), 128), ((32, 96), 32)])  # block 64: tests/models/test_qlora.py
def test_nf4_equals_bitsandbytes_bit_for_bit(shape, block):
    weight = bf16_weight(shape)
    packed, state = bnb.quantize_4bit(weight, blocksize=block, compress_statistics=False, quant_type="nf4")
    ours = quantize(jnp.asarray(weight.float().numpy()), block, False)
    np.testing.assert_array_equal(np.asarray(ours["nf4"]).reshape(-1), packed.reshape(-1).numpy())
    np.testing.assert_array_equal(np.asarray(ours["absmax"]).reshape(-1), state.absmax.numpy())
    dequantized = np.asarray(jax.jit(dequantize)(ours))
    # A bf16 weight dequantizes to bf16 (as HF's QLoRA computes), a float32 one to float32.
    bf16 = bnb.dequantize_4bit(packed, state).view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(dequantized.astype(ml_dtypes.bfloat16), bf16)
    state.dtype = torch.float32
    np.testing.assert_array_equal(dequantized, bnb.dequantize_4bit(packed, state).numpy())


def test_double_quantization_is_within_its_stated_bounds_of_bitsandbytes():
    """The NF4 codes are equal; each absmax code is bitsandbytes' or its neighbour (its CPU search returns the lower
    of two for some values nearer the upper: a few per thousand), the offset and the blocks' scales within a few
    float32 ulps (a mean summed in another order); so each block's absmax within one step of the dynamic map."""
    weight = bf16_weight((512, 1024))
    packed, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    ours = quantize(jnp.asarray(weight.float().numpy()), 64, True)
    np.testing.assert_array_equal(np.asarray(ours["nf4"]).reshape(-1), packed.reshape(-1).numpy())
    codes, theirs = np.asarray(ours["absmax_codes"]).reshape(-1).astype(int), state.absmax.numpy().astype(int)
    assert np.abs(codes - theirs).max() <= 1 and 0 < np.sum(codes != theirs) <= 0.005 * codes.size
    ulps = lambda a, b: np.abs(np.asarray(a, np.float32).view(np.int32) - np.asarray(b, np.float32).view(np.int32))  # noqa: E731
    assert ulps(ours["absmax_offset"], state.offset.numpy()).max() <= 2
    assert ulps(ours["absmax_scale"], state.state2.absmax.numpy()).max() <= 2
    state.dtype = torch.float32
    reference = bnb.dequantize_4bit(packed, state).numpy().reshape(512, 16, 64)
    dequantized = np.asarray(jax.jit(dequantize)(ours)).reshape(512, 16, 64)
    step = np.diff(dynamic_values()).max() * state.state2.absmax.numpy().max()  # one code of the dynamic map
    absmax_gap = np.abs(dequantized - reference).max(axis=-1) / np.abs(nf4_values()).max()
    assert absmax_gap.max() <= 1.01 * step
    same = (codes == theirs).reshape(512, 16)
    assert np.abs(dequantized - reference)[same].max() <= 1e-8  # equal codes: the same weights but for the last bits


def test_int8_is_qwix_s_and_dequantizes_within_half_a_step():
    weight = jnp.asarray(bf16_weight((48, 80)).float().numpy())
    ours = quantize_int8(weight)
    expected = qwix.quantize(weight, jnp.int8, channelwise_axes=(0,))
    np.testing.assert_array_equal(ours["int8"], expected.qvalue)
    assert ours["int8"].dtype == jnp.int8 and ours["scale"].shape == (48, 1)
    assert np.all(np.abs(dequantize(ours) - weight) <= ours["scale"] / 2 * (1 + 1e-4))  # the extreme at 127.5 steps


def test_the_frozen_product_gives_the_dequantized_weight_s_input_gradient_in_fp8_too():
    weight = jnp.asarray(bf16_weight((32, 64)).float().numpy())
    state = quantize(weight, 32, True)
    inputs = jax.random.normal(jax.random.PRNGKey(0), (3, 5, 64))
    dense = dequantize(state)

    def value_and_grad(product):  # one compile each: the products and their input gradients
        return jax.jit(jax.value_and_grad(lambda x: jnp.sum(jnp.sin(product(x)))))(inputs)

    with jax.default_matmul_precision("highest"):
        value, grad = value_and_grad(lambda x: frozen_product(x, state))
        expected_value, expected = value_and_grad(lambda x: x @ dense.T)
    np.testing.assert_allclose(value, expected_value, rtol=0, atol=1e-5)  # a sum of 480 products within 1e-6 each
    np.testing.assert_allclose(grad, expected, rtol=0, atol=1e-6)
    # Under train.fp8: the FP8 product of the dequantized weight, as a float base's projection computes it.
    with jax.default_matmul_precision("highest"), fp8_products():
        fp8_value, fp8_grad = value_and_grad(lambda x: frozen_product(x, state))
        expected_value, expected = value_and_grad(lambda x: dense_dot_general(x, dense.T, (((2,), (0,)), ((), ()))))
    assert abs(fp8_value - value) > 1e-3  # FP8 is on
    np.testing.assert_allclose(fp8_value, expected_value, rtol=0, atol=1e-5)
    np.testing.assert_allclose(fp8_grad, expected, rtol=0, atol=1e-6)


def test_the_section_checks_its_quantization_options():
    assert LoraConfig(base_dtype="nf4").block_size == 64 and LoraConfig(base_dtype="nf4").double_quant
    with pytest.raises(ValueError, match="block_size 48 is not one of bitsandbytes' NF4 block sizes"):
        LoraConfig(base_dtype="nf4", block_size=48)
    with pytest.raises(ValueError, match="block_size set the NF4 quantization of the base; set base_dtype: nf4"):
        LoraConfig(base_dtype="int8", block_size=128)
    saved = LoraConfig(base_dtype="int8").model_dump()  # a checkpoint's meta holds every field: it loads again
    assert LoraConfig(**saved).block_size == 64
    with pytest.raises(ValueError, match="double_quant set the NF4"):
        LoraConfig(double_quant=False)
    with pytest.raises(ValueError, match="base_dtype"):
        LoraConfig(base_dtype="fp4")
