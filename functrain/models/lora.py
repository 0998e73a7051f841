"""LoRA: low-rank adapters on chosen Dense projections of a Flax linen model, the base weights frozen.

``model.lora: {rank, alpha, dropout, targets}`` adds ``lora_a`` [in, rank] and ``lora_b`` [rank, out] beside the
``kernel`` of every Dense whose name or ``/``-joined path matches a target pattern (shell-style: ``q_proj``,
``layers_*/mlp/*``). The layer then computes ``x @ kernel + (alpha / rank) * dropout(x) @ lora_a @ lora_b``, as
PEFT's ``LoraLayer`` does. ``lora_b`` starts at zero, so training starts from the base model exactly.

Only the adapters are trainable: the step differentiates and updates them alone (``trainable_mask``), so the
optimizer holds no state for the base weights and XLA never computes their gradients.
"""

import fnmatch
import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import pydantic
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import PartitionSpec

from functrain.errors import ConfigError

ADAPTER_A, ADAPTER_B = "lora_a", "lora_b"
Path = tuple[str, ...]


class LoraConfig(pydantic.BaseModel):
    """The ``model.lora`` section."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rank: int = pydantic.Field(8, gt=0)
    alpha: float = pydantic.Field(16.0, gt=0)
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)
    targets: tuple[str, ...] = pydantic.Field(("q_proj", "v_proj"), min_length=1)

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank


def projection_paths(params: Any) -> list[Path]:
    """Paths of the modules holding a 2-D ``kernel`` (Dense projections), in tree order."""
    return [path[:-1] for path, leaf in flatten_dict(params).items()
            if path[-1] == "kernel" and len(jnp.shape(leaf)) == 2]


def target_paths(params: Any, targets: tuple[str, ...]) -> list[Path]:
    """The projections matching any pattern; a pattern matching none is a ConfigError naming it."""
    projections = projection_paths(params)
    chosen: set[Path] = set()
    for pattern in targets:
        matched = {p for p in projections if fnmatch.fnmatchcase(p[-1], pattern)
                   or fnmatch.fnmatchcase("/".join(p), pattern)}
        if not matched:
            names = sorted({p[-1] for p in projections})
            raise ConfigError(f"model.lora.targets: {pattern!r} matches no projection of the model; its "
                              f"projections are named {', '.join(names)} (patterns match a name or a path "
                              f"like layers_0/self_attn/q_proj)")
        chosen |= matched
    return [p for p in projections if p in chosen]


def add_adapters(params: Any, paths: list[Path], rank: int, rng: jax.Array) -> Any:
    """``params`` with fresh adapters at ``paths``: ``lora_a`` uniform in ±1/sqrt(in) (PEFT's Kaiming init),
    ``lora_b`` zero."""
    flat = dict(flatten_dict(params))
    for index, path in enumerate(paths):
        fan_in, fan_out = flat[path + ("kernel",)].shape
        bound = fan_in ** -0.5
        flat[path + (ADAPTER_A,)] = jax.random.uniform(jax.random.fold_in(rng, index), (fan_in, rank),
                                                       jnp.float32, -bound, bound)
        flat[path + (ADAPTER_B,)] = jnp.zeros((rank, fan_out), jnp.float32)
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
        delta = jnp.matmul(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                           precision=jax.lax.Precision.HIGHEST)
        flat[path + ("kernel",)] = (jnp.asarray(kernel, jnp.float32) + scale * delta).astype(kernel.dtype)
    return unflatten_dict(flat)


def merged_for_inference(params: Any, model_config: Any) -> Any:
    """``params`` ready for the plain model: adapters merged when the run trained some (as they are otherwise)."""
    settings = getattr(model_config, "lora", None)
    if settings is None or not adapter_paths(params):
        return params
    return merged_params(params, settings.scale)


def adapter_interceptor(settings: LoraConfig, train: bool, rng: jax.Array) -> Callable:
    """A ``nn.intercept_methods`` interceptor adding the adapter path to every Dense that carries adapters."""
    def intercept(next_fun, args, kwargs, context):
        module = context.module
        output = next_fun(*args, **kwargs)
        if (context.method_name != "__call__" or not isinstance(module, nn.Dense)
                or not module.has_variable("params", ADAPTER_A)):
            return output
        x = args[0]
        if train and settings.dropout > 0:
            key = jax.random.fold_in(rng, zlib.crc32("/".join(module.path).encode()))
            keep = jax.random.bernoulli(key, 1.0 - settings.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - settings.dropout), 0).astype(x.dtype)
        a = module.get_variable("params", ADAPTER_A).astype(x.dtype)
        b = module.get_variable("params", ADAPTER_B).astype(x.dtype)
        return output + ((x @ a) @ b * settings.scale).astype(output.dtype)
    return intercept


def with_adapters(apply: Callable, settings: LoraConfig) -> Callable:
    """A program ``apply(params, model_state, inputs, train, rng, **keywords)`` that runs the adapters too
    (keywords: a packed batch's ``segment_ids`` / ``positions``)."""
    def apply_with_adapters(params, model_state, inputs, train, rng, **keywords):
        with nn.intercept_methods(adapter_interceptor(settings, train, rng)):
            return apply(params, model_state, inputs, train, rng, **keywords)
    return apply_with_adapters


def without_adapters(params: Any) -> Any:
    """``params`` with every ``lora_b`` zero: the adapted model then computes its base model exactly
    (``x @ kernel + 0``)."""
    return unflatten_dict({path: jnp.zeros_like(leaf) if path[-1] == ADAPTER_B else leaf
                           for path, leaf in flatten_dict(params).items()})


def adapter_specs(specs: Any, paths: list[Path]) -> Any:
    """Logical specs with the adapters': ``lora_a`` shares the kernel's input axis, ``lora_b`` its output axis."""
    flat = dict(flatten_dict(specs, is_leaf=lambda _, leaf: isinstance(leaf, PartitionSpec)))
    for path in paths:
        kernel = tuple(flat[path + ("kernel",)]) or (None, None)
        flat[path + (ADAPTER_A,)] = PartitionSpec(kernel[0], None)
        flat[path + (ADAPTER_B,)] = PartitionSpec(None, kernel[1])
    return unflatten_dict(flat)


# Folded into the model's init key for the adapters, so a converted base model gets the same adapters
# as a fresh init with the same seed.
_ADAPTER_KEY = 0x10AA


def lora_pieces(module: nn.Module, example_inputs: Any, settings: LoraConfig, argument: str | None = None
                ) -> tuple[Callable, Callable, Callable, Callable, Callable]:
    """``(init, apply, base_apply, logical_specs, complete_params)`` of a linen ``module`` called on
    ``example_inputs``-like inputs, with adapters on ``settings.targets``: ``apply`` runs them, ``base_apply``
    is the base model (a preference run's reference), computed as ``apply`` with every ``lora_b`` zero: the
    same program as the adapted model's, so a policy whose adapters are still zero is bitwise its base (the
    base alone compiles to other code, whose last bits may differ)."""
    from functrain.core.program import linen_pieces

    base_init, base_apply, base_specs = linen_pieces(module, example_inputs, argument)
    paths = target_paths(jax.eval_shape(base_init, jax.random.PRNGKey(0))[0], settings.targets)

    def init(rng: jax.Array) -> tuple[Any, Any]:
        params, model_state = base_init(rng)
        return add_adapters(params, paths, settings.rank, jax.random.fold_in(rng, _ADAPTER_KEY)), model_state

    def complete_params(params: Any, rng: jax.Array) -> Any:
        # A converted (base-only) checkpoint gets fresh adapters; a LoRA checkpoint has its own.
        if adapter_paths(params):
            return params
        return add_adapters(params, paths, settings.rank, jax.random.fold_in(rng, _ADAPTER_KEY))

    adapted = with_adapters(base_apply, settings)

    def adapters_off(params, model_state, inputs, train, rng, **keywords):
        return adapted(without_adapters(params), model_state, inputs, train, rng, **keywords)

    return init, adapted, adapters_off, lambda: adapter_specs(base_specs(), paths), complete_params


def lora_program(module: nn.Module, example_batch: dict[str, Any], kind: str, settings: LoraConfig,
                 fields: Any = None) -> Any:
    """The :class:`functrain.core.program.Program` of a linen ``module`` with adapters on ``settings.targets``
    and the built-in loss of ``kind``; only the adapters are trainable. ``fields``: the data's roles
    (:class:`functrain.core.fields.Fields`) when its names are not the loss's own (HF ``input_ids``)."""
    from functrain.core.fields import canonical
    from functrain.core.program import Program, builtin_loss
    from functrain.core.losses import model_inputs

    named = example_batch if fields is None else canonical(fields, example_batch)
    init, apply, _, specs, complete_params = lora_pieces(module, model_inputs(kind, named), settings,
                                                         getattr(fields, "argument", None))
    return Program(init, builtin_loss(apply, kind, True, fields), builtin_loss(apply, kind, False, fields),
                   specs, trainable=trainable_mask, complete_params=complete_params)
