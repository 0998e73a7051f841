"""The models' dense products (functrain/models/matmul.py): the same values and gradients as ``lax.dot_general`` for
Dense and DenseGeneral layers; on one CPU device the kernel's gradient is taken on a transposed copy of the inputs
(an optimisation barrier keeps XLA from folding it back), over several devices the plain product."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AbstractMesh

from functrain.models.matmul import dense_dot_general

# (inputs, kernel, contracted axes): Dense on a sequence, DenseGeneral to heads, DenseGeneral from heads.
SHAPES = [((3, 5, 16), (16, 8), 1), ((3, 5, 16), (16, 2, 4), 1), ((3, 5, 2, 8), (2, 8, 16), 2)]


def gradients(product, inputs, kernel, contracted):
    dimensions = ((tuple(range(inputs.ndim - contracted, inputs.ndim)), tuple(range(contracted))), ((), ()))
    return jax.value_and_grad(lambda x, w: (jnp.sin(product(x, w, dimensions)) ** 2).sum(), (0, 1))


@pytest.mark.parametrize("inputs_shape, kernel_shape, contracted", SHAPES)
def test_dense_products_and_their_gradients_equal_dot_generals(inputs_shape, kernel_shape, contracted):
    rng = np.random.default_rng(0)
    inputs = jnp.asarray(rng.normal(size=inputs_shape), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
    want = gradients(lax.dot_general, inputs, kernel, contracted)(inputs, kernel)
    got = jax.jit(gradients(dense_dot_general, inputs, kernel, contracted))(inputs, kernel)
    for mine, theirs in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_transposed_copy_is_made_on_one_device_only():
    inputs, kernel = jnp.ones((3, 5, 16)), jnp.ones((16, 8))

    def traced() -> str:
        return str(jax.make_jaxpr(gradients(dense_dot_general, inputs, kernel, 1))(inputs, kernel))

    assert "optimization_barrier" in traced()
    with jax.sharding.use_abstract_mesh(AbstractMesh((2,), ("data",))):
        assert "optimization_barrier" not in traced()
