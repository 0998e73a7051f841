"""Quantized frozen weights (QLoRA's base): a projection stored in NF4 or int8 and dequantized where it is used.

A quantized weight is a dict of arrays in the params tree, in the place of the Dense layer's float ``kernel``, laid
out as bitsandbytes stores an ``nn.Linear`` weight: HF's ``[out, in]`` (the Flax kernel transposed), so an NF4
block is ``block_size`` consecutive input features of one output:

- ``nf4``: ``{"nf4": uint8 [out, in/2]`` (two codes a byte, the even input feature in the high nibble),
  ``"absmax": float32 [out, in/block]}``; with double quantization the absmax is stored as bitsandbytes stores it,
  ``"absmax_codes": uint8 [out, in/block]`` (8-bit codes of absmax minus its mean, in blocks of 256 in that
  order), ``"absmax_scale": float32 [blocks of 256]`` and ``"absmax_offset": float32 []`` (the mean) in its place.
- ``int8``: ``{"int8": int8 [out, in], "scale": float32 [out, 1]}``, symmetric, one scale per output feature.

Against bitsandbytes 0.50 (its CPU path; ``tests/models/test_quantized.py``): the NF4 codes and the absmax equal
its ``quantize_4bit`` bit for bit, and so does the dequantized weight without double quantization. With it, the
absmax codes differ in two ways, both bounded: bitsandbytes' CPU kernel finds a code with a table search that
returns the lower of two neighbours for some values nearer the upper (a few per thousand codes; its CUDA kernel
and its own reference kernel take the nearest, as we do), so a code is at most one step of the dynamic map off;
and its offset is torch's float32 mean, ours XLA's (which multiplies by 1/n and may fuse the subtraction after
it), so the offset and the blocks' scales may differ in their last bits.

qwix (Google's JAX quantization library, the ``quant`` extra) quantizes and dequantizes int8 (``qwix.quantize``,
``qwix.dequantize``) and gives the 16 NF4 values. Written here, each for a reason: NF4's quantization, to round as
bitsandbytes rounds (the block's values times the reciprocal of its absmax, then the midpoints between the 16
values; qwix divides by the scale and takes the nearest value by distance: the same codes on the million weights
we compared, but a weight within a float32 rounding of a midpoint may go either way); double quantization (qwix
has none); the 4-bit packing (a uint8 array of half the weights' count: what Orbax saves and ``plan`` counts,
where a uint4 array may take a byte a code); NF4's dequantization as a chain of selects (:func:`_lookup`: qwix
gathers from the table, which the TPU compiler turns into a one-hot product 30 times the weight's float32 size);
and :func:`frozen_product`, whose backward pass dequantizes the weight again instead of keeping it (the base gets
no gradient; dequantized weights kept for the backward pass would hold the whole base in float again).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import PartitionSpec

from functrain.core.fp8 import fp8_enabled, gradient_rounded, to_fp8
from functrain.core.precision import is_quantized
from functrain.errors import ConfigError
from functrain.models.stacking import in_stack, layer_shape

Array = jax.Array
Path = tuple[str, ...]
# bitsandbytes' double quantization: the absmax scales in blocks of 256, on its signed 8-bit dynamic map.
ABSMAX_BLOCK = 256


def _qwix() -> Any:
    """qwix, imported where a quantized base is used: it is the ``quant`` extra, not a core dependency."""
    try:
        import qwix
    except ImportError:
        raise ConfigError("model.lora.base_dtype needs qwix; pip install 'functrain[quant]'") from None
    return qwix


def nf4_values() -> Array:
    """The 16 NF4 values (QLoRA's Appendix E), float32, as qwix dequantizes its codes."""
    qwix = _qwix()
    codes = jnp.arange(16, dtype=jnp.uint4)
    return qwix.dequantize(qwix.QArray(codes, jnp.ones((1,), jnp.float32), qtype="nf4"))


@functools.cache
def dynamic_values() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map(signed=True)``), bit for bit: for each decade
    ``10^(i-6)``, ``i < 7``, the means of ``2^i + 1`` points spaced evenly over [0.1, 1] (torch's float32
    ``linspace``: a fused multiply-add from the nearer end), both signs, then 0 and 1, sorted."""
    values = [0.0, 1.0]
    start, end = np.float32(0.1), np.float32(1.0)
    for i in range(7):
        points = 2**i + 1
        step = np.float64((end - start) / np.float32(points - 1))
        index = np.arange(points)
        spaced = np.where(index < points // 2, start + step * index, end - step * (points - 1 - index))
        spaced = spaced.astype(np.float32)
        means = np.float32(10.0 ** (i - 6)) * ((spaced[:-1] + spaced[1:]) / np.float32(2))
        values += [*means, *(-means)]
    return np.sort(np.array(values, np.float32))


def _blockwise_codes(blocks: Array, table: Array) -> tuple[Array, Array]:
    """bitsandbytes' blockwise rounding of ``blocks`` [..., block]: each block's absmax, and each value times the
    absmax's reciprocal (clipped to [-1, 1]) put in the ``table`` entry whose midpoints hold it (a value on a
    midpoint takes the lower entry). bitsandbytes clamps absmax at 1e-38 for the reciprocal, we at float32's
    smallest normal: they differ only where a block's absmax is below it, whose values then round to 0 alike."""
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    reciprocal = 1.0 / jnp.maximum(absmax, jnp.finfo(jnp.float32).tiny)
    scaled = jnp.clip(blocks * reciprocal[..., None], -1.0, 1.0)
    midpoints = (table[:-1] + table[1:]) / 2
    codes = jnp.searchsorted(midpoints, scaled, side="left", method="compare_all")
    return codes.astype(jnp.uint8), absmax


def quantize_nf4(weight: Array, block_size: int, double_quant: bool) -> dict[str, Array]:
    """The NF4 form of ``weight`` [out, in] (float; ``in`` a multiple of ``block_size``), as bitsandbytes'
    ``quantize_4bit(weight, blocksize, compress_statistics=double_quant, quant_type="nf4")`` makes it."""
    out_features, in_features = weight.shape
    blocks = jnp.asarray(weight, jnp.float32).reshape(out_features, in_features // block_size, block_size)
    codes, absmax = _blockwise_codes(blocks, nf4_values())
    pairs = codes.reshape(out_features, in_features // 2, 2)
    state = {"nf4": (pairs[..., 0] << 4) | pairs[..., 1]}
    if not double_quant:
        return {**state, "absmax": absmax}
    offset = jnp.mean(absmax)
    centered = (absmax - offset).reshape(-1)
    padded = jnp.pad(centered, (0, -centered.size % ABSMAX_BLOCK)).reshape(-1, ABSMAX_BLOCK)
    absmax_codes, absmax_scale = _blockwise_codes(padded, jnp.asarray(dynamic_values()))
    return {
        **state,
        "absmax_codes": absmax_codes.reshape(-1)[: centered.size].reshape(absmax.shape),
        "absmax_scale": absmax_scale,
        "absmax_offset": offset,
    }


def quantize_int8(weight: Array) -> dict[str, Array]:
    """The int8 form of ``weight`` [out, in]: qwix's symmetric quantization with one scale per output feature."""
    quantized = _qwix().quantize(jnp.asarray(weight, jnp.float32), jnp.int8, channelwise_axes=(0,))
    return {"int8": quantized.qvalue, "scale": quantized.scale}


def _nf4_lookup(codes: Array) -> Array:
    """The NF4 values of ``codes``, by a chain of 15 selects that XLA fuses with the unpacking and the scaling: a
    gather from the table leaves the weight's float32 values in memory as well (on a v5e, dequantizing one of Llama
    3 8B's MLP weights for a product takes 0.96 GiB of temporaries with a gather, 0.44 GiB this way, and 14.5 GiB
    through ``qwix.dequantize``, whose vmapped gather the TPU compiler turns into a one-hot product)."""
    table = nf4_values()
    values = jnp.full(codes.shape, table[0], jnp.float32)
    for index in range(1, 16):
        values = jnp.where(codes == index, table[index], values)
    return values


def _absmax(state: dict[str, Array]) -> Array:
    """An NF4 weight's block absmax [out, in/block], dequantized from its 8-bit codes under double quantization
    (bitsandbytes: the dynamic map's value times the block's scale, plus the offset, in float32)."""
    if "absmax" in state:
        return state["absmax"]
    codes = state["absmax_codes"]
    flat = jnp.asarray(dynamic_values())[codes.reshape(-1)]
    padded = jnp.pad(flat, (0, -flat.size % ABSMAX_BLOCK)).reshape(-1, ABSMAX_BLOCK)
    scaled = (padded * state["absmax_scale"][:, None]).reshape(-1)[: flat.size]
    return (scaled + state["absmax_offset"]).reshape(codes.shape)


def dequantize(state: dict[str, Array]) -> Array:
    """The float32 weight [out, in] a quantized ``state`` stores."""
    qwix = _qwix()
    if "int8" in state:
        return qwix.dequantize(qwix.QArray(state["int8"], state["scale"], qtype=jnp.int8))
    packed = state["nf4"]
    out_features = packed.shape[0]
    codes = jnp.stack([packed >> 4, packed & 0xF], axis=-1).reshape(out_features, -1)
    absmax = _absmax(state)
    blocks = _nf4_lookup(codes).reshape(*absmax.shape, -1)
    return (blocks * absmax[..., None]).reshape(out_features, -1)


def quantize_kernel(kernel: Array, base_dtype: str, block_size: int, double_quant: bool) -> dict[str, Array]:
    """A Flax Dense ``kernel`` [in, out] quantized as ``base_dtype`` (``nf4`` or ``int8``)."""
    weight = jnp.asarray(kernel).T
    return quantize_nf4(weight, block_size, double_quant) if base_dtype == "nf4" else quantize_int8(weight)


def kernel_shape(node: Any) -> tuple[int, ...]:
    """The shape of a Dense kernel, float or quantized: ``[in, out]``, after a scanned stack's ``layers`` axis."""
    if not is_quantized(node):
        return tuple(np.shape(node))
    *lead, out_features, in_features = np.shape(node["int8"] if "int8" in node else node["nf4"])
    return (*lead, in_features if "int8" in node else 2 * in_features, out_features)


def _layerwise(function: Any, tree: Any, stacked: bool) -> Any:
    """``function`` of ``tree``, or of each layer of a scanned stack's ``tree`` (leading axis), stacked again: a layer
    computes what it would unrolled."""
    if not stacked:
        return function(tree)
    count = jax.tree.leaves(tree)[0].shape[0]
    layers = [function(jax.tree.map(operator.itemgetter(index), tree)) for index in range(count)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)


def dequantized_params(params: Any) -> Any:
    """``params`` with every quantized weight replaced by its float32 kernel [in, out] (stacked ``[layers, in, out]``
    in a scan): the plain model's params, for export, sampling and merging adapters."""

    def restore(node: Any) -> Any:
        if not is_quantized(node):
            return node
        return _layerwise(lambda state: dequantize(state).T, node, len(kernel_shape(node)) == 3)

    return jax.tree.map(restore, params, is_leaf=is_quantized)


def has_quantized(params: Any) -> bool:
    """Whether ``params`` hold a quantized weight."""
    return any(is_quantized(node) for node in jax.tree.leaves(params, is_leaf=is_quantized))


def weight_count(params: Any) -> int:
    """The number of weights ``params`` hold, a quantized weight counted as its ``in x out`` (not its bytes)."""
    leaves = jax.tree.leaves(params, is_leaf=is_quantized)
    return sum(int(np.prod(kernel_shape(leaf) if is_quantized(leaf) else np.shape(leaf))) for leaf in leaves)


def _zero_cotangent(leaf: Array) -> Any:
    if jnp.issubdtype(leaf.dtype, jnp.floating):
        return jnp.zeros_like(leaf)
    return np.zeros(leaf.shape, jax.dtypes.float0)


def _product(inputs: Array, state: dict[str, Array]) -> Array:
    # The weight is dequantized once the inputs are there, not earlier: XLA would otherwise be free to dequantize
    # every layer's weight up front (they depend on nothing the step computes).
    inputs, state = jax.lax.optimization_barrier((inputs, state))
    weight = dequantize(state).astype(inputs.dtype)
    if fp8_enabled():  # train.fp8: as a float base's projection (functrain.models.matmul.dense_dot_general)
        inputs, weight = to_fp8(inputs), to_fp8(weight)
    return jax.lax.dot_general(inputs, weight, (((inputs.ndim - 1,), (1,)), ((), ())))


@jax.custom_vjp
def frozen_product(inputs: Array, state: dict[str, Array]) -> Array:
    """``inputs [..., in] @ W.T`` for the quantized weight ``state`` (W [out, in]), in ``inputs``' dtype: the
    product of a frozen Dense layer. Its backward pass gives the inputs' gradient only, from the weight dequantized
    again once the gradient is there: nothing of the size of the weight is kept between the passes. Traced with
    FP8 projections (``train.fp8``), it is the FP8 product a float base's layer computes: both operands rounded to
    E4M3, the gradient arriving at its output to E5M2."""
    return _product(inputs, state)


def _forward(inputs: Array, state: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    return _product(inputs, state), state


def _backward(state: dict[str, Array], grad: Array) -> tuple[Array, Any]:
    # The barrier ties the second dequantization to the gradient: without it XLA finds it equal to the forward
    # pass's, keeps that one and with it every layer's dequantized weight until the backward pass reaches it
    # (a plan of Llama 3 8B under QLoRA: 58 GiB of temporaries for 16 GiB of bf16 weights).
    grad, state = jax.lax.optimization_barrier((grad, state))
    weight = dequantize(state).astype(grad.dtype)
    if fp8_enabled():  # the gradient in E5M2, the weight in E4M3, as gradient_to_fp8 and to_fp8 give a float base
        grad, weight = gradient_rounded(grad), to_fp8(weight)
    inputs_grad = jax.lax.dot_general(grad, weight, (((grad.ndim - 1,), (0,)), ((), ())))
    return inputs_grad, jax.tree.map(_zero_cotangent, state)


frozen_product.defvjp(_forward, _backward)


def quantized_dense(module: nn.Dense, inputs: Array) -> Array:
    """What the Dense ``module``, whose kernel is quantized, computes for ``inputs`` (as ``nn.Dense`` does: in its
    ``dtype``, or the inputs' promoted with float32, plus its bias)."""
    dtype = module.dtype or jnp.promote_types(inputs.dtype, jnp.float32)
    output = frozen_product(jnp.asarray(inputs, dtype), module.get_variable("params", "kernel"))
    if module.use_bias:
        output = output + jnp.asarray(module.get_variable("params", "bias"), dtype)
    return output


def dense_layers(init: Any, rng: jax.Array) -> tuple[Any, set[Path]]:
    """The abstract params of ``init(rng) -> (params, model_state)`` (a linen model's) and the paths of the
    ``nn.Dense`` layers its forward pass calls: the layers whose kernels a quantized base replaces."""
    called: set[Path] = set()

    def record(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        if context.method_name == "__call__" and isinstance(context.module, nn.Dense):
            called.add(tuple(context.module.path))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        params = jax.eval_shape(init, rng)[0]
    return params, called


def frozen_kernel_paths(params: Any, dense: set[Path], heads: tuple[str, ...], settings: Any) -> list[Path]:
    """The Dense layers (paths) whose kernels a ``settings.base_dtype`` base quantizes: every layer's but the LM
    head's (``heads``: its module names; it stays in float, as bitsandbytes leaves ``lm_head``). A weight it
    cannot quantize is a ConfigError naming it: a kernel no ``nn.Dense`` multiplies by (a ``DenseGeneral``'s, a
    mixture of experts' stacked weights) or, in NF4, one whose input features ``block_size`` does not divide."""
    chosen = []
    for path, leaf in flatten_dict(params).items():
        module, name, shape = path[:-1], path[-1], layer_shape(path, np.shape(leaf))
        if any(part in heads for part in module):
            continue
        experts = "experts" in path and len(shape) == 3
        if name != "kernel" and not experts:
            continue
        if experts or len(shape) != 2 or module not in dense:
            what = "a mixture of experts' stacked weights" if experts else f"a {list(shape)} kernel no nn.Dense uses"
            raise ConfigError(
                f"model.lora.base_dtype: {settings.base_dtype} cannot quantize {'/'.join(path)}, {what} (it "
                f"quantizes the Dense layers' 2-D kernels); remove model.lora.base_dtype to train on a float base"
            )
        if settings.base_dtype == "nf4" and shape[0] % settings.block_size:
            raise ConfigError(
                f"model.lora.block_size: {settings.block_size} does not divide the {shape[0]} input features of "
                f"{'/'.join(module)}; set model.lora.block_size to one that does (a power of two from 32)"
            )
        chosen.append(module)
    return chosen


def quantized_specs(specs: Any, paths: list[Path], settings: Any) -> Any:
    """Logical specs with each quantized kernel's: its ``[out, in]`` arrays take the kernel's axes swapped, the
    double quantization's blocks of 256 and offset are replicated (a few bytes per million weights); a scanned
    stack's arrays keep its ``layers`` axis first."""
    flat = dict(flatten_dict(specs, is_leaf=lambda _, leaf: isinstance(leaf, PartitionSpec)))
    for path in paths:
        stack = 1 if in_stack(path) else 0
        *lead, kernel_in, kernel_out = tuple(flat.pop(path + ("kernel",))) or (None,) * (2 + stack)
        swapped = PartitionSpec(*lead, kernel_out, kernel_in)
        if settings.base_dtype == "int8":
            state = {"int8": swapped, "scale": PartitionSpec(*lead, kernel_out, None)}
        elif settings.double_quant:
            state = {"nf4": swapped, "absmax_codes": swapped, "absmax_scale": PartitionSpec(*lead, None),
                     "absmax_offset": PartitionSpec(*lead)}  # fmt: skip
        else:
            state = {"nf4": swapped, "absmax": swapped}
        flat.update({path + ("kernel", key): spec for key, spec in state.items()})
    return unflatten_dict(flat)


def quantize_params(params: Any, paths: list[Path], settings: Any) -> Any:
    """``params`` with the float kernels of the Dense layers at ``paths`` quantized as ``settings`` (a
    ``model.lora`` section) says; kernels already quantized stay as they are."""
    if not paths:
        return params
    options = (settings.base_dtype, settings.block_size, settings.double_quant)
    quantize = jax.jit(quantize_kernel, static_argnums=(1, 2, 3))
    flat = dict(flatten_dict(params, is_leaf=lambda _, node: is_quantized(node)))
    for path in paths:
        kernel = flat[path + ("kernel",)]
        if not is_quantized(kernel):
            flat[path + ("kernel",)] = _layerwise(lambda layer: quantize(layer, *options), kernel, in_stack(path))
    return unflatten_dict(flat)
