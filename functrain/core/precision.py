"""Precision policy: parameters stored in ``train.param_dtype`` (float32 master weights, or bfloat16), the
forward/backward pass in ``train.compute_dtype``, dynamic loss scaling for float16."""

from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PARAM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Dynamic loss scaling as in mixed-precision practice: halve on overflow, double after a run of good steps.
LOSS_SCALE_INIT = 2.0**15
LOSS_SCALE_GROWTH_INTERVAL = 2000
LOSS_SCALE_MIN = 1.0


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast the floating-point leaves of ``tree`` to ``dtype``; integer leaves are left alone."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def cast_like(tree: Any, reference: Any) -> Any:
    """``tree``'s leaves in the dtypes of ``reference``'s (gradients -> the parameters' dtype)."""
    return jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, reference)


def update_loss_scale(scale: jax.Array, good_steps: jax.Array, grads_finite: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The next (loss scale, good-step count) after a step whose scaled gradients were finite or not."""
    grow = good_steps + 1 >= LOSS_SCALE_GROWTH_INTERVAL
    finite_scale = jnp.where(grow, scale * 2.0, scale)
    finite_good = jnp.where(grow, 0, good_steps + 1)
    overflow_scale = jnp.maximum(scale / 2.0, LOSS_SCALE_MIN)
    new_scale = jnp.where(grads_finite, finite_scale, overflow_scale)
    new_good = jnp.where(grads_finite, finite_good, 0)
    return new_scale.astype(jnp.float32), new_good.astype(jnp.int32)
