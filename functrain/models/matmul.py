"""The built-in models' dense products on CPU, with a weight gradient XLA:CPU hands to its fast kernels.

A dense layer's weight gradient is ``x^T @ dy``, a product contracting the tokens, the first axis of both operands.
XLA:CPU folds the transpose into the product, and a product of that form is not handed to YNNPACK: it runs on
XLA's own kernel at about a third of the speed (bench_grpo's Llama: ``[992, 256]^T @ [992, 64]`` 387 us, against
154 us for YNNPACK on a transposed copy, 200 us with the copy made). :func:`dense_dot_general` is ``lax.dot_general``
with that gradient computed on a transposed copy of ``x``, kept from being folded back by an optimisation barrier.
The forward pass and the input's gradient are the plain products. On other platforms (whose compilers read
transposed operands as they are) and over several devices it is ``lax.dot_general``.

Under ``train.fp8`` (:mod:`functrain.core.fp8`) :func:`dense_dot_general` is an FP8 product: the attention and MLP
projections of every built-in model. The LM head and the MoE router take :func:`unquantized_dot_general` (their
outputs feed a softmax over the vocabulary or the experts, where FP8's three mantissa bits cost quality, as
torchtitan also leaves its output layer in bfloat16); the MoE experts' grouped products do not pass here at all.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
from jax import lax

from functrain.core.fp8 import fp8_enabled, gradient_to_fp8, to_fp8
from functrain.models.batch_invariant import batch_invariant, invariant_dense
from functrain.parallel.target import target_platform

Array = jax.Array


def dense_dot_general(
    lhs: Array, rhs: Array, dimension_numbers: Any, precision: Any = None, preferred_element_type: Any = None
) -> Array:
    """A projection's product: :func:`unquantized_dot_general`, with both operands rounded to E4M3 and the
    gradient arriving at its output to E5M2 when the program is traced with FP8 projections (``train.fp8``)."""
    if not fp8_enabled():
        return unquantized_dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    product = unquantized_dot_general(to_fp8(lhs), to_fp8(rhs), dimension_numbers, precision, preferred_element_type)
    return gradient_to_fp8(product)


def unquantized_dot_general(
    lhs: Array, rhs: Array, dimension_numbers: Any, precision: Any = None, preferred_element_type: Any = None
) -> Array:
    """``lax.dot_general`` for a dense layer's product (the inputs' trailing axes against the kernel's leading
    ones, no batch axes) whose gradient for the kernel is a product XLA:CPU hands to YNNPACK, when the program is
    compiled for one CPU device; other products, and every product of a program over several devices (the barrier
    would keep the partitioner from splitting the copy), are ``lax.dot_general`` itself. In a batch-invariant
    model (:mod:`functrain.models.batch_invariant`) a dense product runs in tiles of one shape."""
    (lhs_contracting, rhs_contracting), batch = dimension_numbers
    contracted = len(lhs_contracting)
    dense = (
        batch == ((), ())
        and tuple(lhs_contracting) == tuple(range(lhs.ndim - contracted, lhs.ndim))
        and tuple(rhs_contracting) == tuple(range(contracted))
        and lhs.ndim > contracted
    )
    if dense and batch_invariant():
        return invariant_dense(lhs, rhs, contracted, precision, preferred_element_type)
    if not dense or preferred_element_type is not None or not _one_cpu_device():
        return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return _dense_vjp(lhs, rhs, contracted, precision)


def _one_cpu_device() -> bool:
    """Whether the program being traced is compiled for CPUs, on a mesh of one device (or none)."""
    return target_platform() == "cpu" and jax.sharding.get_abstract_mesh().size <= 1


def _flat(lhs: Array, rhs: Array, contracted: int) -> tuple[int, int, int]:
    """``(rows, contracted size, features)`` of a dense product."""
    inner = math.prod(rhs.shape[:contracted])
    return math.prod(lhs.shape) // inner, inner, math.prod(rhs.shape) // inner


def _product(lhs: Array, rhs: Array, contracted: int, precision: Any) -> Array:
    rows, inner, features = _flat(lhs, rhs, contracted)
    flat = lax.dot(lhs.reshape(rows, inner), rhs.reshape(inner, features), precision=precision)
    return flat.reshape(*lhs.shape[: lhs.ndim - contracted], *rhs.shape[contracted:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dense_vjp(lhs: Array, rhs: Array, contracted: int, precision: Any) -> Array:
    return _product(lhs, rhs, contracted, precision)


def _forward(lhs: Array, rhs: Array, contracted: int, precision: Any) -> tuple[Array, tuple[Array, Array]]:
    return _product(lhs, rhs, contracted, precision), (lhs, rhs)


def _backward(contracted: int, precision: Any, residuals: tuple[Array, Array], grad: Array) -> tuple[Array, Array]:
    lhs, rhs = residuals
    rows, inner, features = _flat(lhs, rhs, contracted)
    flat_grad = grad.reshape(rows, features)
    lhs_grad = lax.dot_general(flat_grad, rhs.reshape(inner, features), (((1,), (1,)), ((), ())), precision)
    transposed = lax.optimization_barrier(lhs.reshape(rows, inner).T)  # a copy XLA does not fold into the product
    rhs_grad = lax.dot(transposed, flat_grad, precision=precision)
    return lhs_grad.reshape(lhs.shape).astype(lhs.dtype), rhs_grad.reshape(rhs.shape).astype(rhs.dtype)


_dense_vjp.defvjp(_forward, _backward)
