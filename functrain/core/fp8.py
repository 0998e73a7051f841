"""FP8 projections (``train.fp8``): a dense layer's product with both operands rounded to E4M3 and the gradient
arriving at its output rounded to E5M2, each tensor scaled by its own current absolute maximum.

Current ("dynamic") scaling, as torchtitan's default (tensorwise): the scale of a tensor is computed from that very
tensor, in the same step. The other choice, delayed scaling (``flax.linen.fp8_ops``: a scale from the history of
past maxima, held as parameters whose "gradients" overwrite them), would put state in the train state and in the
optimizer's path, and a bad maximum (inf/NaN) would poison the history for as many steps as it holds. Here there
is no state: nothing to checkpoint, resume is bitwise as without FP8, and a non-finite maximum comes only from a
non-finite tensor, whose step the step's non-finite policy (``train.nonfinite``) skips like any other. The price is
one more reduction per tensor (the maximum) before each product, which XLA fuses into the cast.

Flax's ``fp8_ops.qdq`` (quantize then dequantize at a given scale) and ``get_fp8_max`` do the rounding; what it
lacks for current scaling (the scale from the tensor itself, and the straight-through rounding of inputs and
gradients without state) is the three small functions below. On a GPU with FP8 tensor cores (compute capability
8.9 or more: Ada, Hopper, Blackwell) XLA rewrites "dequantized FP8 operands into a product" into one FP8 GEMM; on
other devices the same program runs with the products in ``train.compute_dtype`` on FP8-rounded values: FP8's
numerics, none of its speed (:func:`hardware_note`).

The switch is a trace-time context (:func:`fp8_products`), as ``jax.default_matmul_precision`` is for
``train.matmul_precision``: the backend traces its train and eval steps inside it, and the built-in models' dense
products (:func:`functrain.models.matmul.dense_dot_general`) read it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

FORWARD_DTYPE = jnp.float8_e4m3fn  # activations and weights: more mantissa
GRADIENT_DTYPE = jnp.float8_e5m2  # gradients: more range
# The GPU compute capability from which XLA runs FP8 products on tensor cores (Ada, Hopper and later).
FP8_COMPUTE_CAPABILITY = 8.9

_FP8_PRODUCTS: ContextVar[bool] = ContextVar("fp8_products", default=False)


@contextlib.contextmanager
def fp8_products(enabled: bool = True) -> Iterator[None]:
    """Within the block (while a program is traced), the built-in models' projections are FP8 products, or not."""
    token = _FP8_PRODUCTS.set(enabled)
    try:
        yield
    finally:
        _FP8_PRODUCTS.reset(token)


def fp8_enabled() -> bool:
    """Whether the program being traced asked for FP8 projections (:func:`fp8_products`)."""
    return _FP8_PRODUCTS.get()


def with_fp8(fn: Callable, enabled: bool) -> Callable:
    """``fn`` traced with FP8 projections when ``enabled`` (otherwise ``fn`` itself)."""
    if not enabled:
        return fn

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        with fp8_products():
            return fn(*args, **kwargs)

    return traced


def current_scale(x: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The float32 scale that maps ``x``'s absolute maximum onto ``fp8_dtype``'s largest value. An all-zero tensor
    gets a tiny positive scale (zero stays zero); a non-finite maximum gives a non-finite scale, and the product a
    non-finite result that the step's non-finite policy refuses."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.maximum(amax / fp8_ops.get_fp8_max(fp8_dtype, jnp.float32), jnp.finfo(jnp.float32).tiny)


def _round(x: jax.Array, fp8_dtype: Any) -> jax.Array:
    return fp8_ops.qdq(x, fp8_dtype, current_scale(x, fp8_dtype), x.dtype)


@jax.custom_vjp
def to_fp8(x: jax.Array) -> jax.Array:
    """``x`` rounded to E4M3 at its current scale (in its own dtype); the gradient passes through unchanged."""
    return _round(x, FORWARD_DTYPE)


to_fp8.defvjp(lambda x: (_round(x, FORWARD_DTYPE), None), lambda _, grad: (grad,))


@jax.custom_vjp
def gradient_to_fp8(y: jax.Array) -> jax.Array:
    """``y`` itself; the gradient arriving at it is rounded to E5M2 at its current scale."""
    return y


gradient_to_fp8.defvjp(lambda y: (y, None), lambda _, grad: (gradient_rounded(grad),))


def gradient_rounded(grad: jax.Array) -> jax.Array:
    """``grad`` rounded to E5M2 at its current scale: the gradient a product's backward pass multiplies by (for a
    hand-written backward pass, as a frozen quantized weight's, :mod:`functrain.models.quantized`)."""
    return _round(grad, GRADIENT_DTYPE)


def hardware_note(device: Any) -> str | None:
    """One line on what ``train.fp8`` does on ``device`` when it cannot run FP8 products fast; None on a GPU that
    can."""
    if device.platform == "gpu":
        try:
            if float(getattr(device, "compute_capability", "")) >= FP8_COMPUTE_CAPABILITY:
                return None
        except ValueError:  # no CUDA capability (a ROCm GPU): XLA's E4M3FN products are not fast there either
            pass
    name = device.platform if device.platform == "cpu" else f"{device.platform} ({device.device_kind})"
    return (
        f"train.fp8 on {name}: FP8 is emulated here (each projection's operands and gradients rounded to FP8, the "
        f"products in train.compute_dtype): FP8's numerics, none of its speed; FP8 products need a GPU of compute "
        f"capability {FP8_COMPUTE_CAPABILITY} or more"
    )
