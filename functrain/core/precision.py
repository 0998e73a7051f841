"""Precision policy: parameters stored in ``train.param_dtype`` (float32 master weights, or bfloat16), the
forward/backward pass in ``train.compute_dtype``, its products at ``train.matmul_precision``, dynamic loss scaling
for float16."""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
PARAM_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# Dynamic loss scaling as in mixed-precision practice: halve on overflow, double after a run of good steps.
LOSS_SCALE_INIT = 2.0**15
LOSS_SCALE_GROWTH_INTERVAL = 2000
LOSS_SCALE_MIN = 1.0


def matmul_precision(setting: str, compute_dtype: str, platform: str) -> str | None:
    """The precision a program's products are traced at (``jax.default_matmul_precision``) for
    ``train.matmul_precision`` on ``platform``; None: XLA's default.

    ``auto`` is ``highest`` for float32 compute on a GPU or TPU, where XLA's default rounds float32 operands (to TF32
    on a GPU, to one bfloat16 pass on a TPU), and XLA's default elsewhere: float32 compute then means float32, as in
    PyTorch. On an H100 with XLA's default, GRPO's sampler and train step were 2e-3 apart in log-prob
    (``rollout/logprob_gap``), 1e-5 at ``highest``. XLA:CPU multiplies float32 in float32 either way; products of
    bfloat16 operands take one pass at any setting."""
    if setting == "auto":
        return "highest" if compute_dtype == "float32" and platform != "cpu" else None
    return None if setting == "default" else setting


def at_precision(fn: Callable, precision: str | None) -> Callable:
    """``fn`` with its products traced at ``precision`` (None: ``fn`` itself): a jitted program carries it, whatever
    the caller's context."""
    if precision is None:
        return fn

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with jax.default_matmul_precision(precision):
            return fn(*args, **kwargs)

    return traced


# A weight stored quantized (a QLoRA base, :mod:`functrain.models.quantized`) is a dict holding its codes under one
# of these keys beside its scales. The scales are part of the number it stores, not weights of their own: casts
# leave the whole dict as it is (bitsandbytes keeps them in float32 whatever the compute dtype, as do we).
QUANTIZED_CODES = ("nf4", "int8")


def is_quantized(node: Any) -> bool:
    """Whether ``node`` of a params tree is a quantized weight (the dict of its codes and scales)."""
    return isinstance(node, Mapping) and any(key in node for key in QUANTIZED_CODES)


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Cast the floating-point leaves of ``tree`` to ``dtype``; integer leaves and quantized weights are left
    alone."""
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        return x if is_quantized(x) or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)

    return jax.tree.map(cast, tree, is_leaf=is_quantized)


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
