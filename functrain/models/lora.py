"""LoRA: low-rank adapters on chosen Dense projections of a Flax linen model, the base weights frozen.

``model.lora: {rank, alpha, dropout, targets}`` adds ``lora_a`` [in, rank] and ``lora_b`` [rank, out] beside the
``kernel`` of every Dense whose name or ``/``-joined path matches a target pattern (shell-style: ``q_proj``,
``layers_*/mlp/*``). The layer then computes ``x @ kernel + (alpha / rank) * dropout(x) @ lora_a @ lora_b``, as
PEFT's ``LoraLayer`` does. ``lora_b`` starts at zero, so training starts from the base model exactly.

Only the adapters are trainable: the step differentiates and updates them alone (``trainable_mask``), so the
optimizer holds no state for the base weights and XLA never computes their gradients.

QLoRA: ``model.lora.base_dtype: nf4 | int8`` stores every Dense layer's kernel but the LM head's quantized
(:mod:`functrain.models.quantized`), dequantized where the layer multiplies by it.

Scanned layers (``model.scan_layers``): a stacked kernel ``[layers, in, out]`` gets stacked adapters
``[layers, in, rank]`` and ``[layers, rank, out]`` (and a quantized base stacked codes), which the scan slices per
layer as it does the kernel; targets match each layer's unrolled path, each layer's ``lora_a`` is the one the
unrolled model draws, and restored params of either layout are put in the model's.
"""

import fnmatch
import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import PartitionSpec

from functrain.core.precision import is_quantized
from functrain.core.unembedding import LOGITS_CHUNK
from functrain.errors import ConfigError
from functrain.models.configs.base import ModelConfig
from functrain.models.configs.lora import LoraConfig
from functrain.models.head import HEAD_MODULES
from functrain.models.quantized import (
    dense_layers,
    dequantized_params,
    frozen_kernel_paths,
    kernel_shape,
    quantize_params,
    quantized_dense,
    quantized_specs,
)
from functrain.models.stacking import in_stack, layer_paths, layer_shape, relayout_layers

ADAPTER_A, ADAPTER_B = "lora_a", "lora_b"
Path = tuple[str, ...]


def projection_paths(params: Any) -> list[Path]:
    """Paths of the modules holding a 2-D ``kernel`` (Dense projections; stacked ``[layers, in, out]`` in a scan),
    in tree order."""
    return [
        path[:-1]
        for path, leaf in flatten_dict(params).items()
        if path[-1] == "kernel" and len(layer_shape(path, jnp.shape(leaf))) == 2
    ]


def _matches(path: Path, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path[-1], pattern) or fnmatch.fnmatchcase("/".join(path), pattern)


def _layers(paths: list[Path], params: Any) -> dict[Path, list[Path]]:
    """Each module of ``paths`` as the modules of its layers: itself when unrolled, the unrolled path of each of
    its stack's layers when scanned (in the order of the stack's leading axis)."""
    kernels = {
        "/".join(path + ("kernel",)): jax.ShapeDtypeStruct(kernel_shape(_kernel_leaf(params, path)), jnp.float32)
        for path in paths
    }
    stacked = layer_paths(kernels)
    return {
        path: [tuple(name.split("/")[:-1]) for name in stacked.get("/".join(path + ("kernel",)), [])] or [path]
        for path in paths
    }


def _matched(path: Path, layers: list[Path], pattern: str) -> bool:
    """Whether ``pattern`` targets the module ``path`` (``layers``: its layers' own paths); a pattern matching some
    layers of a scanned stack only is a ConfigError (a stack's adapters are every layer's)."""
    count = sum(_matches(layer, pattern) for layer in layers)
    if 0 < count < len(layers):
        raise ConfigError(
            f"model.lora.targets: {pattern!r} matches {count} of the {len(layers)} scanned layers of "
            f"{'/'.join(path)} (scanned layers carry adapters on all of them or none); target every layer or set "
            f"model.scan_layers=false"
        )
    return count > 0


def target_paths(params: Any, targets: tuple[str, ...]) -> list[Path]:
    """The projections matching any pattern (a scanned stack's layers matched by their unrolled paths,
    ``layers_3/mlp/up_proj``); a pattern matching none, or a mixture of experts' stacked expert weights (which
    carry no adapters), is a ConfigError naming it."""
    projections = projection_paths(params)
    layers = _layers(projections, params)
    experts = [
        path
        for path, leaf in flatten_dict(params).items()
        if "experts" in path and len(layer_shape(path, jnp.shape(leaf))) == 3
    ]
    chosen: set[Path] = set()
    for pattern in targets:
        stacked = next((path for path in experts if _matches(path, pattern)), None)
        if stacked is not None:
            raise ConfigError(
                f"model.lora.targets: {pattern!r} names the stacked experts {'/'.join(stacked)}, which LoRA does "
                f"not adapt; target the attention projections (q_proj, k_proj, v_proj, o_proj) or a path that "
                f"leaves the experts out"
            )
        matched = {p for p in projections if _matched(p, layers[p], pattern)}
        if not matched:
            names = sorted({p[-1] for p in projections})
            raise ConfigError(
                f"model.lora.targets: {pattern!r} matches no projection of the model; its "
                f"projections are named {', '.join(names)} (patterns match a name or a path "
                f"like layers_0/self_attn/q_proj)"
            )
        chosen |= matched
    return [p for p in projections if p in chosen]


def _kernel_leaf(params: Any, path: Path) -> Any:
    """The ``kernel`` of the module at ``path`` (a float array, or a quantized weight's dict)."""
    node = params
    for name in path + ("kernel",):
        node = node[name]
    return node


def add_adapters(params: Any, paths: list[Path], rank: int, rng: jax.Array) -> Any:
    """``params`` with fresh adapters at ``paths``: ``lora_a`` uniform in ±1/sqrt(in) (PEFT's Kaiming init),
    ``lora_b`` zero. Each layer's ``lora_a`` is drawn from the key of its rank among the adapted layers' unrolled
    paths, so a scanned stack gets the adapters the unrolled model does."""
    flat = dict(flatten_dict(params, is_leaf=lambda _, node: is_quantized(node)))
    layers = _layers(paths, params)
    index = {layer: position for position, layer in enumerate(sorted(p for each in layers.values() for p in each))}
    for path in paths:
        *lead, fan_in, fan_out = kernel_shape(flat[path + ("kernel",)])
        bound = fan_in**-0.5
        drawn = [
            jax.random.uniform(jax.random.fold_in(rng, index[layer]), (fan_in, rank), jnp.float32, -bound, bound)
            for layer in layers[path]
        ]
        flat[path + (ADAPTER_A,)] = jnp.stack(drawn) if lead else drawn[0]
        flat[path + (ADAPTER_B,)] = jnp.zeros((*lead, rank, fan_out), jnp.float32)
    return unflatten_dict(flat)


def is_adapter(path: Path) -> bool:
    """Whether a parameter path names an adapter leaf."""
    return path[-1] in (ADAPTER_A, ADAPTER_B)


def trainable_mask(params: Any) -> Any:
    """True at adapter leaves, False at base weights (same structure as ``params``)."""
    return unflatten_dict({path: is_adapter(path) for path in flatten_dict(params)})


def adapter_paths(params: Any) -> list[Path]:
    """Paths of the modules carrying adapters."""
    return [path[:-1] for path in flatten_dict(params) if path[-1] == ADAPTER_A]


def merged_params(params: Any, scale: float) -> Any:
    """Base params with each adapted kernel replaced by ``kernel + scale * lora_a @ lora_b`` (float32)."""
    flat = dict(flatten_dict(params))
    for path in adapter_paths(params):
        a, b = flat.pop(path + (ADAPTER_A,)), flat.pop(path + (ADAPTER_B,))
        kernel = flat[path + ("kernel",)]
        delta = jnp.matmul(
            jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        flat[path + ("kernel",)] = (jnp.asarray(kernel, jnp.float32) + scale * delta).astype(kernel.dtype)
    return unflatten_dict(flat)


def merged_for_inference(params: Any, model_config: ModelConfig) -> Any:
    """``params`` ready for the plain model: a quantized base dequantized (float32), adapters merged when the run
    trained some (as they are otherwise)."""
    settings = model_config.lora_settings()
    if settings is None:
        return params
    if settings.base_dtype is not None:
        params = dequantized_params(params)
    return merged_params(params, settings.scale) if adapter_paths(params) else params


def adapter_interceptor(settings: LoraConfig, train: bool, rng: jax.Array) -> Callable:
    """A ``nn.intercept_methods`` interceptor adding the adapter path to every Dense that carries adapters (and
    computing a Dense whose kernel is quantized from its quantized form)."""

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or not isinstance(module, nn.Dense):
            return next_fun(*args, **kwargs)
        quantized = module.has_variable("params", "kernel") and is_quantized(module.get_variable("params", "kernel"))
        output = quantized_dense(module, args[0]) if quantized else next_fun(*args, **kwargs)
        if not module.has_variable("params", ADAPTER_A):
            return output
        x = args[0]
        if train and settings.dropout > 0:
            # A scanned layer's path is its whole stack's: its key is the scan's own for the layer.
            if in_stack(module.path):
                key = module.make_rng("dropout")
            else:
                key = jax.random.fold_in(rng, zlib.crc32("/".join(module.path).encode()))
            keep = jax.random.bernoulli(key, 1.0 - settings.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - settings.dropout), 0).astype(x.dtype)
        a: jax.Array = module.get_variable("params", ADAPTER_A).astype(x.dtype)
        b: jax.Array = module.get_variable("params", ADAPTER_B).astype(x.dtype)
        return output + ((x @ a) @ b * settings.scale).astype(output.dtype)

    return intercept


def with_adapters(apply: Callable, settings: LoraConfig, adapts_head: bool = False) -> Callable:
    """A program ``apply(params, model_state, inputs, train, rng, **keywords)`` that runs the adapters too
    (keywords: a packed batch's ``segment_ids`` / ``positions``). ``adapts_head``: an LM head carries adapters,
    so it is applied whole (an unapplied head, :mod:`functrain.models.head`, would leave its adapters out)."""

    def apply_with_adapters(params, model_state, inputs, train, rng, **keywords):
        if adapts_head:
            keywords.pop(LOGITS_CHUNK, None)
        with nn.intercept_methods(adapter_interceptor(settings, train, rng)):
            return apply(params, model_state, inputs, train, rng, **keywords)

    return apply_with_adapters


def without_adapters(params: Any) -> Any:
    """``params`` with every ``lora_b`` zero: the adapted model then computes its base model exactly
    (``x @ kernel + 0``)."""
    return unflatten_dict(
        {path: jnp.zeros_like(leaf) if path[-1] == ADAPTER_B else leaf for path, leaf in flatten_dict(params).items()}
    )


def adapter_specs(specs: Any, paths: list[Path]) -> Any:
    """Logical specs with the adapters': ``lora_a`` shares the kernel's input axis, ``lora_b`` its output axis (and
    both a scanned stack's ``layers`` axis)."""
    flat = dict(flatten_dict(specs, is_leaf=lambda _, leaf: isinstance(leaf, PartitionSpec)))
    for path in paths:
        *lead, kernel_in, kernel_out = tuple(flat[path + ("kernel",)]) or (None,) * (3 if in_stack(path) else 2)
        flat[path + (ADAPTER_A,)] = PartitionSpec(*lead, kernel_in, None)
        flat[path + (ADAPTER_B,)] = PartitionSpec(*lead, None, kernel_out)
    return unflatten_dict(flat)


# Folded into the model's init key for the adapters, so a converted base model gets the same adapters
# as a fresh init with the same seed.
_ADAPTER_KEY = 0x10AA


def lora_transform(pieces: Any, settings: LoraConfig) -> Any:
    """The model's :class:`~functrain.core.program.ModelPieces` with adapters on ``settings.targets``: ``apply``
    runs them, ``frozen_apply`` is the same model with them off (the base weights alone: a preference run's
    reference, with no second copy), only the adapters are trainable, and a restored base-only checkpoint
    (a converted model) gets fresh adapters. With ``settings.base_dtype`` the base's Dense kernels (the LM head's
    aside) are stored quantized, and a restored checkpoint's float kernels are quantized on the way in. A Flax
    linen model only: the adapters are added by intercepting its Dense layers."""
    from functrain.core.adapters import ModelPieces

    if pieces.framework != "linen":
        raise ConfigError("model.lora adapts a Flax linen model; remove model.lora")
    base_init, base_apply, base_specs = pieces.init, pieces.apply, pieces.logical_specs
    abstract, dense = dense_layers(base_init, jax.random.PRNGKey(0))
    paths = target_paths(abstract, settings.targets)
    frozen = [] if settings.base_dtype is None else frozen_kernel_paths(abstract, dense, HEAD_MODULES, settings)

    def init(rng: jax.Array) -> tuple[Any, Any]:
        params, model_state = base_init(rng)
        params = add_adapters(params, paths, settings.rank, jax.random.fold_in(rng, _ADAPTER_KEY))
        return quantize_params(params, frozen, settings), model_state

    def complete_params(params: Any, rng: jax.Array) -> Any:
        # Saved with the layers scanned or not, the params come in the model's layout. A converted (base-only)
        # checkpoint gets fresh adapters; a LoRA checkpoint has its own. A float base is quantized as it comes in
        # (a converted QLoRA base already is).
        params = quantize_params(relayout_layers(params, abstract), frozen, settings)
        if adapter_paths(params):
            return params
        return add_adapters(params, paths, settings.rank, jax.random.fold_in(rng, _ADAPTER_KEY))

    adapted = with_adapters(base_apply, settings, adapts_head=any(path[-1] in HEAD_MODULES for path in paths))

    def adapters_off(params, model_state, inputs, train, rng, **keywords):
        # The adapted program with every lora_b zero, not the base alone: a policy whose adapters are still zero
        # is then bitwise its base (the base alone compiles to other code, whose last bits may differ).
        return adapted(without_adapters(params), model_state, inputs, train, rng, **keywords)

    return ModelPieces(
        init,
        adapted,
        lambda: quantized_specs(adapter_specs(base_specs(), paths), frozen, settings),
        framework=pieces.framework,
        frozen_apply=adapters_off,
        trainable=trainable_mask,
        complete_params=complete_params,
        adapter_checkpoints=True,
        end_of_step=pieces.end_of_step,
    )


def lora_program(
    module: nn.Module, example_batch: dict[str, Any], kind: str, settings: LoraConfig, fields: Any = None
) -> Any:
    """The :class:`functrain.core.program.Program` of a linen ``module`` with adapters on ``settings.targets``
    and the built-in loss of ``kind`` (research code's entry; runs apply :func:`lora_transform` through their
    task). ``fields``: the data's roles when its names are not the loss's own (HF ``input_ids``)."""
    from functrain.core.adapters import model_inputs_of, model_pieces
    from functrain.core.fields import resolve_fields
    from functrain.core.program import builtin_program

    fields = fields if fields is not None else resolve_fields(example_batch, kind=kind)
    pieces = model_pieces(module, model_inputs_of(fields, example_batch), example_batch, fields.argument)
    return builtin_program(lora_transform(pieces, settings), fields, example_batch)
