"""Device mesh, logical-axis rules and the shardings of the train state and batches.

Models name their parameter axes with *logical* names (``embed``, ``mlp``, ``heads``, ...). Rules map each
logical name to mesh axes of a ``("data", "fsdp", "expert", "tensor")`` mesh, so one model runs data-parallel,
FSDP (ZeRO-3: parameters and optimizer moments sharded on ``embed``), expert-parallel (a mixture of experts'
stacked experts sharded on ``expert``) or tensor-parallel by config alone:

    mesh = make_mesh(config.mesh)
    rules = logical_rules(config.mesh)
    params_sh = param_shardings(task.logical_specs(), abstract_params, mesh, rules)
    state_sh = state_shardings(abstract_state, params_sh, mesh)

Batches are split over ``data``, ``fsdp`` and ``expert`` together (FSDP is data parallelism whose parameters
are gathered on use; outside the experts, expert parallelism is data parallelism too), whatever the rules say.

Parameters without logical axis names (user models that do not annotate them) follow, in order:

1. ``mesh.param_rules``: the first ``{pattern, spec}`` whose regular expression matches the parameter's path
   (``re.search`` on ``block_0/dense/kernel``) gives its mesh spec (one entry per dimension); these rules win
   over logical names too.
2. The default rule: FSDP over the parameter's largest dimension that the ``fsdp`` axis size divides
   (the first such on a tie); replicated when none does (logged once with the parameters' names), and
   replicated on a mesh without an ``fsdp`` axis larger than 1.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from functrain.core.tree import path_string
from functrain.data.global_array import BATCH_AXES
from functrain.errors import ConfigError

logger = logging.getLogger(__name__)

# ``expert`` before ``tensor``: the batch axes stay outermost, so each process holds a contiguous block of rows;
# ``pipeline`` (the stages of the scanned layers, :mod:`functrain.parallel.pipeline`) outside them. ``context``
# splits the sequence (:mod:`functrain.parallel.context`); ``tensor`` stays innermost.
MESH_AXES = ("pipeline", "data", "fsdp", "expert", "context", "tensor")
# The config key of the slices a mesh axis spans over the data-centre network (DCN). A multi-slice mesh keeps
# the same axes: ``data`` is ``mesh.dcn_data`` slices x ``mesh.data`` chips in each, slices outermost, so every
# rule, the batch split and the models' constraints are the same on one slice and on several.
DCN_AXES = {"pipeline": "dcn_pipeline", "data": "dcn_data", "fsdp": "dcn_fsdp"}

# Logical axis -> mesh axis (None: replicated). Names missing here are replicated too.
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "embed": "fsdp",
    "mlp": "tensor",
    "expert": "expert",  # the leading axis of a mixture of experts' stacked experts
    "heads": "tensor",
    "kv_heads": "tensor",
    "vocab": "tensor",
    "head_dim": None,
    "latent": None,  # the compressed width of latent attention (DeepSeek's q/kv LoRA ranks)
    "max_len": None,
    "classes": None,
    "norm": None,
    "layers": "pipeline",  # the stacked axis of scanned layers (model.scan_layers): split into pipeline stages
}

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


# ----------------------------------------------------------------------------------------------- mesh


def _mesh_sizes(mesh_config: Any) -> dict[str, int]:
    # An axis a mesh config leaves out (research code's own namespace) has size 1.
    return {axis: int(getattr(mesh_config, axis, 1)) for axis in MESH_AXES}


def _fitting_mesh(sizes: dict[str, int], device_count: int) -> dict[str, int]:
    """A mesh for ``device_count`` devices that keeps as much of the requested tensor/expert/fsdp sizes as fits."""
    fit = {}
    remaining = device_count
    for axis in ("tensor", "context", "expert", "fsdp", "pipeline"):
        wanted = sizes[axis]
        fit[axis] = wanted if wanted > 0 and remaining % wanted == 0 else 1
        remaining //= fit[axis]
    fit["data"] = remaining
    return {axis: fit[axis] for axis in MESH_AXES}


def _format_mesh(sizes: Mapping[str, int]) -> str:
    return " ".join(f"mesh.{axis}={size}" for axis, size in sizes.items())


def resolve_mesh_shape(mesh_config: Any, device_count: int) -> dict[str, int]:
    """The mesh axis sizes for ``device_count`` devices, with a ``-1`` axis taking the rest.

    Raises ConfigError (one line with the device count and a mesh that fits) when they do not fit.
    """
    sizes = _mesh_sizes(mesh_config)
    unknown = [axis for axis, size in sizes.items() if size == -1]
    bad = [axis for axis, size in sizes.items() if size == 0 or size < -1]
    fix = f"use e.g. {_format_mesh(_fitting_mesh(sizes, device_count))}"
    if bad:
        raise ConfigError(
            f"mesh.{bad[0]}={sizes[bad[0]]} is not a size; each mesh axis is >= 1 or -1 "
            f"(the rest of the {device_count} devices); {fix}"
        )
    if len(unknown) > 1:
        raise ConfigError(
            f"{_format_mesh(sizes)}: only one mesh axis may be -1; {device_count} devices are available, {fix}"
        )
    known = math.prod(size for size in sizes.values() if size > 0)
    if unknown:
        if device_count % known:
            raise ConfigError(f"{_format_mesh(sizes)}: {device_count} devices are not divisible by {known}; {fix}")
        sizes[unknown[0]] = device_count // known
    elif known != device_count:
        raise ConfigError(f"{_format_mesh(sizes)} needs {known} devices but {device_count} are available; {fix}")
    return sizes


def make_mesh(mesh_config: Any, devices: list | None = None) -> Mesh:
    """The :data:`MESH_AXES` mesh over all (global) devices, or ``devices``.

    ``mesh_config`` has ``.pipeline``, ``.data``, ``.fsdp``, ``.expert`` and ``.tensor`` (a missing one is 1); one
    may be ``-1`` (the rest). Axes are
    ``Auto`` so the compiler propagates shardings through the step from the in/out shardings alone.
    The device order is process-major (``jax.make_mesh``), which the global-batch assembly relies on.
    Devices that span several TPU slices (their ``slice_index``) get a hybrid mesh: ``mesh_config.dcn_data``,
    ``.dcn_fsdp`` and ``.dcn_pipeline`` slices extend the data, FSDP and pipeline axes, slices outermost
    (:data:`DCN_AXES`); their product must be the number of slices, and the other sizes are then per slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    slices = slice_count(devices)
    dcn = dcn_shape(mesh_config)
    if math.prod(dcn.values()) != slices:
        spans = " x ".join(f"mesh.{DCN_AXES[axis]}={dcn[axis]}" for axis in DCN_AXES)
        raise ConfigError(
            f"{spans} spans {math.prod(dcn.values())} slice(s) but the {len(devices)} devices are {slices} "
            f"slice(s); make the product of the mesh.dcn_* sizes {slices}"
        )
    sizes = resolve_mesh_shape(mesh_config, len(devices) // slices)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    try:
        if slices > 1:
            # Slices outermost on each axis they extend: a collective over the rest of the axis stays in a slice.
            hybrid = mesh_utils.create_hybrid_device_mesh(shape, tuple(dcn[axis] for axis in MESH_AXES), devices)
            return Mesh(hybrid, MESH_AXES, axis_types=axis_types)
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError as exc:  # a TPU torus that these axis sizes cannot be laid along
        raise ConfigError(
            f"{_format_mesh(sizes)} cannot be laid on the {len(devices)} devices' torus "
            f"({str(exc).splitlines()[0][:160]}); make each mesh axis a product of the torus "
            f"dimensions (e.g. mesh.tensor equal to one of them)"
        ) from None


def slice_count(devices: list) -> int:
    """How many TPU slices ``devices`` span (their ``slice_index``; 1 for devices without one)."""
    return len({getattr(device, "slice_index", 0) for device in devices})


def dcn_shape(mesh_config: Any) -> dict[str, int]:
    """How many slices each mesh axis spans over the data-centre network: ``mesh.dcn_data`` extends the data
    axis, ``mesh.dcn_fsdp`` the FSDP axis, ``mesh.dcn_pipeline`` the pipeline axis (:data:`DCN_AXES`); the others
    stay in a slice."""
    return {axis: int(getattr(mesh_config, DCN_AXES[axis], 1)) if axis in DCN_AXES else 1 for axis in MESH_AXES}


# ---------------------------------------------------------------------------------------------- rules


def logical_rules(mesh_config: Any) -> Rules:
    """:data:`DEFAULT_RULES` updated by ``mesh_config.rules``, as ``((logical, mesh_axes), ...)``.

    A rule value is a mesh axis, a list of mesh axes (the dimension is split over their product) or
    None (replicated). A rule naming an axis that is not one of :data:`MESH_AXES` is a ConfigError.
    """
    rules = dict(DEFAULT_RULES)
    for logical, target in (getattr(mesh_config, "rules", None) or {}).items():
        if isinstance(target, (list, tuple)):
            target = tuple(target) if target else None
        for axis in target if isinstance(target, tuple) else (target,):
            if axis is not None and axis not in MESH_AXES:
                raise ConfigError(
                    f"mesh.rules.{logical}={axis!r} names unknown mesh axis {axis!r}; "
                    f"use one of {', '.join(MESH_AXES)} or null (replicated)"
                )
        rules[logical] = target
    return tuple(rules.items())


def _as_axes(target: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def _mesh_spec(
    name: str,
    logical: PartitionSpec | None,
    shape: tuple[int, ...],
    mesh: Mesh,
    rules: dict[str, tuple[str, ...]],
    allow_replicated_fallback: bool,
) -> PartitionSpec:
    """The mesh PartitionSpec of one parameter; checks that each sharded dimension divides evenly."""
    names = tuple(logical) if logical is not None else ()
    if len(names) > len(shape):
        raise ConfigError(
            f"parameter {name!r} has {len(shape)} dimensions but {len(names)} logical axis names "
            f"{names}; fix the model's logical partitioning"
        )
    used: set[str] = set()
    spec = []
    for dim, logical_name in enumerate(names):
        axes = rules.get(logical_name, ()) if isinstance(logical_name, str) else ()
        # A mesh axis may shard only one dimension of an array; a second use (possible with custom rules)
        # leaves that dimension replicated rather than failing.
        axes = tuple(axis for axis in axes if axis not in used and mesh.shape.get(axis, 1) > 1)
        ways = math.prod(mesh.shape[axis] for axis in axes)
        if axes and shape[dim] % ways:
            named = " x ".join(map(repr, axes))
            axes_text = f"mesh axis {named} (size {ways})" if len(axes) == 1 else f"mesh axes {named} (size {ways})"
            if not allow_replicated_fallback:
                raise ConfigError(
                    f"parameter {name!r} dimension {dim} (size {shape[dim]}, logical axis {logical_name!r}) is "
                    f"not divisible by {axes_text}; change the mesh sizes, set "
                    f"mesh.rules.{logical_name}=null, or set mesh.allow_replicated_fallback=true"
                )
            logger.warning(
                "parameter %s dimension %d (size %d, logical axis %r) is not divisible by %s; "
                "replicating that dimension",
                name,
                dim,
                shape[dim],
                logical_name,
                axes_text,
            )
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def default_spec(shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec | None:
    """The default rule for an unannotated parameter: FSDP over its largest dimension the ``fsdp`` axis
    divides; ``PartitionSpec()`` without an fsdp axis; None when no dimension divides (replicated)."""
    ways = mesh.shape.get("fsdp", 1)
    if ways == 1 or not shape:
        return PartitionSpec()
    fitting = [dim for dim in range(len(shape)) if shape[dim] % ways == 0]
    if not fitting:
        return None
    dim = max(fitting, key=lambda d: (shape[d], -d))
    return PartitionSpec(*([None] * dim + ["fsdp"]))


def pattern_spec(name: str, shape: tuple[int, ...], rule: Any, index: int, mesh: Mesh) -> PartitionSpec:
    """The spec ``mesh.param_rules[index]`` gives parameter ``name``, checked against its shape and the mesh."""
    where = f"mesh.param_rules[{index}] (pattern {rule.pattern!r})"
    if len(rule.spec) > len(shape):
        raise ConfigError(
            f"{where} gives {len(rule.spec)} axes to parameter {name!r} of shape {list(shape)}; "
            f"give at most {len(shape)} or narrow the pattern"
        )
    spec = []
    for dim, target in enumerate(rule.spec):
        axes = _as_axes(tuple(target) if isinstance(target, list) else target)
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"{where} names unknown mesh axis {axis!r}; use one of {', '.join(MESH_AXES)} or null (replicated)"
                )
        ways = math.prod(mesh.shape[axis] for axis in axes)
        if shape[dim] % ways:
            raise ConfigError(
                f"{where}: parameter {name!r} dimension {dim} (size {shape[dim]}) is not divisible "
                f"by {' x '.join(axes)} (size {ways}); change the rule's spec or the mesh sizes"
            )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def param_shardings(
    logical_specs: Any,
    abstract_params: Any,
    mesh: Mesh,
    rules: Rules,
    allow_replicated_fallback: bool = False,
    param_rules: Any = (),
) -> Any:
    """A ``NamedSharding`` per parameter, from its logical axis names and the rules.

    Args:
      logical_specs: tree of ``PartitionSpec`` of logical names (``Program.logical_specs()``), the same
        structure as the params; a ``None`` spec means replicated.
      abstract_params: the params (arrays or ``jax.ShapeDtypeStruct``), for their shapes.
      mesh: from :func:`make_mesh`.
      rules: from :func:`logical_rules`.
      allow_replicated_fallback: replicate (with a warning) a dimension its mesh axes do not divide,
        instead of raising a ConfigError naming the parameter, dimension and mesh axis.
      param_rules: ``mesh.param_rules`` entries (``.pattern``, ``.spec``), tried first (module docstring);
        a rule that matches no parameter is a ConfigError.
    """
    rule_map = {logical: _as_axes(target) for logical, target in rules}
    param_rules = list(param_rules)
    matched: set[int] = set()
    replicated: list[str] = []

    def one(path: tuple, leaf: Any, logical: PartitionSpec | None) -> NamedSharding:
        name, shape = path_string(path), tuple(np.shape(leaf))
        index = next((i for i, rule in enumerate(param_rules) if re.search(rule.pattern, name)), None)
        if index is not None:
            matched.add(index)
            return NamedSharding(mesh, pattern_spec(name, shape, param_rules[index], index, mesh))
        if not logical and shape:  # no logical axis names: the default rule
            spec = default_spec(shape, mesh)
            if spec is None:
                replicated.append(name)
            return NamedSharding(mesh, spec or PartitionSpec())
        return NamedSharding(mesh, _mesh_spec(name, logical, shape, mesh, rule_map, allow_replicated_fallback))

    shardings = jax.tree_util.tree_map_with_path(one, abstract_params, logical_specs)
    unused = [i for i in range(len(param_rules)) if i not in matched]
    if unused:
        raise ConfigError(
            f"mesh.param_rules[{unused[0]}] (pattern {param_rules[unused[0]].pattern!r}) matches no "
            f"parameter; fix the pattern (paths look like "
            f"{path_string(jax.tree_util.tree_flatten_with_path(abstract_params)[0][0][0])!r})"
        )
    if replicated:
        logger.warning(
            "%d parameter(s) without logical axes have no dimension divisible by mesh.fsdp=%d and are replicated: %s",
            len(replicated),
            mesh.shape.get("fsdp", 1),
            ", ".join(replicated[:8]),
        )
    return shardings


# ---------------------------------------------------------------------------------------------- state


def _key_names(path: tuple) -> tuple[str, ...]:
    return tuple(path_string((key,)) for key in path)


def state_shardings(abstract_state: Any, params_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for a whole (abstract) TrainState, with ``abstract_state``'s structure.

    Parameters get ``params_shardings``. An optimizer-state leaf whose key path ends with a parameter's
    path and has its shape (Adam's ``mu``/``nu``, momentum) gets that parameter's sharding, so FSDP
    shards the moments too. Everything else (step, counts, rng, loss scale, model state) is replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())
    by_path: dict[tuple[str, ...], tuple[tuple[int, ...], NamedSharding]] = {}
    params = getattr(abstract_state, "params", None)
    if params is not None:
        for (path, leaf), sharding in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_shardings)
        ):
            by_path[_key_names(path)] = (tuple(np.shape(leaf)), sharding)
    depth = max((len(path) for path in by_path), default=0)

    def one(path: tuple, leaf: Any) -> NamedSharding:
        names, shape = _key_names(path), tuple(np.shape(leaf))
        if not shape:
            return replicated
        # Longest matching suffix first, so "a/kernel" wins over a top-level "kernel".
        for length in range(min(depth, len(names)), 0, -1):
            match = by_path.get(names[-length:])
            if match is not None and match[0] == shape:
                return match[1]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_state)


# -------------------------------------------------------------------------------------------- batches


def constrain_batch(x: jax.Array, batch_axis: int = 0) -> jax.Array:
    """Pin an activation's batch axis to ``("data", "fsdp", "expert")``, and the sequence axis after it of a
    ``[B, T, ...]`` activation to ``context`` (context parallelism), leaving its other axes to the compiler.

    Models call this on the residual stream (block inputs/outputs, logits). Without it the partitioner may
    follow the FSDP-sharded ``embed`` axis of the weights into the activations and reshard whole batches
    instead of gathering the (much smaller) parameters, which is what ZeRO-3 means. Active only while
    tracing under ``jax.set_mesh(mesh)`` with those axes; elsewhere (a plain ``apply``) it returns ``x``.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    axes = tuple(axis for axis in BATCH_AXES if axis in mesh.axis_names)
    if not axes or x.shape[batch_axis] % math.prod(mesh.shape[axis] for axis in axes):
        return x
    spec: list[Any] = [PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[batch_axis] = axes
    context = mesh.shape.get("context", 1)
    if context > 1 and x.ndim > batch_axis + 2 and x.shape[batch_axis + 1] % context == 0:
        spec[batch_axis + 1] = "context"
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))


def batch_devices(mesh: Mesh) -> int:
    """How many ways the batch is split: ``data * fsdp * expert``. The global batch must divide by
    ``micro_batches`` times this."""
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES if axis in mesh.axis_names)


# ------------------------------------------------------------------------------------------- describe


def _bytes(leaf: Any) -> int:
    return int(np.prod(np.shape(leaf), dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def _shard_bytes(leaf: Any, sharding: Any) -> int:
    shape = tuple(np.shape(leaf))
    shard = sharding.shard_shape(shape) if hasattr(sharding, "shard_shape") else shape
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


def human_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"


def state_bytes_per_device(state_or_abstract: Any, shardings: Any) -> tuple[int, int]:
    """``(bytes on each device, total bytes)`` of a state, from each leaf's sharding's shard shape."""
    leaves = jax.tree.leaves(state_or_abstract)
    shards = jax.tree.leaves(shardings)
    return (
        sum(_shard_bytes(leaf, sharding) for leaf, sharding in zip(leaves, shards)),
        sum(_bytes(leaf) for leaf in leaves),
    )


def describe(state_or_abstract: Any, shardings: Any, mesh: Mesh, top: int = 5) -> str:
    """A few lines for the startup log and ``functrain inspect``: the mesh, the sharding of the ``top``
    largest parameters and the bytes of state per device (from the shardings' shard shapes)."""
    sizes = " ".join(f"{axis}={size}" for axis, size in mesh.shape.items())
    lines = [f"mesh: {sizes} ({mesh.devices.size} devices, {jax.process_count()} process(es))"]
    params = getattr(state_or_abstract, "params", state_or_abstract)
    params_sh = getattr(shardings, "params", shardings)
    flat = [
        (path, leaf, sharding)
        for (path, leaf), sharding in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_sh))
    ]
    flat.sort(key=lambda item: -_bytes(item[1]))
    count = sum(int(np.prod(np.shape(leaf))) for _, leaf, _ in flat)
    lines.append(f"largest of {len(flat)} parameters ({count:,} values):")
    width = max((len(path_string(path)) for path, _, _ in flat[:top]), default=0)
    for path, leaf, sharding in flat[:top]:
        shape = "x".join(map(str, np.shape(leaf))) or "scalar"
        lines.append(
            f"  {path_string(path):<{width}}  {shape:>12} {np.dtype(leaf.dtype).name:<8} "
            f"{getattr(sharding, 'spec', sharding)}"
        )
    per_device, total = state_bytes_per_device(state_or_abstract, shardings)
    lines.append(
        f"state per device: {human_bytes(per_device)} of {human_bytes(total)} total ({per_device / max(total, 1):.1%})"
    )
    return "\n".join(lines)
