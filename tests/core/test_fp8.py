"""FP8 products (``train.fp8``, functrain/core/fp8.py): operands on the E4M3 grid at their current scale, gradients
on the E5M2 grid, straight through otherwise; a zero tensor stays zero, a non-finite one is not hidden; the LM
head stays unquantized; the one-line note for devices without FP8 products."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functrain.core.fp8 import fp8_products, gradient_to_fp8, hardware_note, to_fp8
from functrain.models.matmul import dense_dot_general, unquantized_dot_general

DENSE = (((1,), (0,)), ((), ()))


def _levels(values) -> int:
    """How many distinct magnitudes ``values`` take."""
    return len(np.unique(np.abs(np.asarray(values))))


def test_operands_land_on_the_e4m3_grid_at_their_current_scale_and_the_gradient_passes_straight_through():
    x = jax.random.normal(jax.random.PRNGKey(0), (64, 32)) * 3.0
    rounded = to_fp8(x)
    amax = float(jnp.max(jnp.abs(x)))
    assert float(jnp.max(jnp.abs(rounded))) == pytest.approx(amax, rel=1e-6)  # the maximum maps onto E4M3's max
    assert np.array_equal(to_fp8(rounded), rounded)  # on the grid already (the same scale: the same maximum)
    assert _levels(x) > 1000 and _levels(rounded) <= 127  # E4M3: 126 positive finite values and zero
    assert 0 < float(jnp.max(jnp.abs(rounded - x))) <= amax * 2.0**-4  # at most half a step of 3 mantissa bits
    assert np.array_equal(jax.grad(lambda v: jnp.sum(to_fp8(v) * 2.0))(x), np.full(x.shape, 2.0, np.float32))


def test_the_gradient_arriving_at_a_product_is_rounded_to_e5m2_and_the_forward_value_is_untouched():
    y = jax.random.normal(jax.random.PRNGKey(1), (32, 32))
    upstream = jax.random.normal(jax.random.PRNGKey(2), (32, 32)) * 1e-3
    assert np.array_equal(gradient_to_fp8(y), y)
    grad = jax.grad(lambda v: jnp.sum(gradient_to_fp8(v) * upstream))(y)
    assert _levels(upstream) > 1000 and _levels(grad) <= 124  # E5M2: 123 positive finite values and zero
    assert float(jnp.max(jnp.abs(grad))) == pytest.approx(float(jnp.max(jnp.abs(upstream))), rel=1e-6)
    assert 0 < float(jnp.max(jnp.abs(grad - upstream))) <= float(jnp.max(jnp.abs(upstream))) * 2.0**-3


def test_a_zero_tensor_stays_zero_and_a_non_finite_one_makes_the_product_non_finite():
    @jax.jit
    def products(zeros, poisoned, rhs):
        with fp8_products():
            return to_fp8(zeros), dense_dot_general(poisoned, rhs, DENSE)

    zero, product = products(jnp.zeros((4, 4)), jnp.ones((4, 4)).at[1, 2].set(jnp.inf), jnp.ones((4, 3)))
    assert np.array_equal(zero, np.zeros((4, 4)))
    assert not np.all(np.isfinite(product))  # the step's non-finite policy sees it (tests/run/test_fp8_training.py)


def test_only_projections_traced_with_fp8_products_are_fp8_and_the_head_never_is():
    @jax.jit
    def products(lhs, rhs):
        plain = dense_dot_general(lhs, rhs, DENSE), unquantized_dot_general(lhs, rhs, DENSE)
        with fp8_products():
            traced = dense_dot_general(lhs, rhs, DENSE), unquantized_dot_general(lhs, rhs, DENSE)
        return plain, traced, to_fp8(lhs) @ to_fp8(rhs)

    lhs = jax.random.normal(jax.random.PRNGKey(3), (8, 32))
    rhs = jax.random.normal(jax.random.PRNGKey(4), (32, 16))
    (not_asked, exact), (fp8, head), rounded_product = jax.tree.map(np.asarray, products(lhs, rhs))
    assert np.array_equal(not_asked, exact)  # not asked for: unchanged
    assert np.allclose(fp8, rounded_product, rtol=1e-6, atol=1e-6)
    assert 1e-3 < np.max(np.abs(fp8 - exact)) / np.max(np.abs(exact)) < 0.1
    assert np.array_equal(head, exact)


@pytest.mark.parametrize(
    "device, emulated",
    [
        (SimpleNamespace(platform="cpu", device_kind="cpu"), True),
        (SimpleNamespace(platform="tpu", device_kind="TPU v5p"), True),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA A100", compute_capability="8.0"), True),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA H100", compute_capability="9.0"), False),
        (SimpleNamespace(platform="gpu", device_kind="NVIDIA L4", compute_capability="8.9"), False),
    ],
)
def test_devices_without_fp8_products_get_one_line_saying_it_is_emulated(device, emulated):
    note = hardware_note(device)
    assert (note is not None) == emulated
    if emulated:
        assert "emulated" in note and device.platform in note and "\n" not in note
