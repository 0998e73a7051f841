"""HF checkpoint ⇄ functrain params: `read_params`, `load_pretrained`, `save_pretrained`.

Conversion is strict: every HF tensor must map to a functrain leaf (or be on the architecture's allow-list
of buffers and tied heads), every leaf must be filled, and every shape must agree with config.json. All of
that is checked from file headers before any tensor data is read. Quantised checkpoints are dequantized as they
are read: MXFP4 (config.json's ``quantization_config.quant_method: mxfp4``, the released GPT-OSS weights;
:mod:`torch_bridge.hf.mxfp4`) and block-scaled FP8 (``fp8``, the released DeepSeek-V3 weights;
:mod:`torch_bridge.hf.fp8`).
"""

import logging
import math
import os
import re
from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.core.model_output import logits_of
from functrain.errors import CheckpointError
from functrain.models import build_model
from functrain.models.configs.base import ModelConfig
from functrain.models.stacking import unstack_layers
from torch_bridge.hf import fp8, mxfp4, reader, writer
from torch_bridge.hf.architectures import Architecture, architecture_for, exported_architecture
from torch_bridge.hf.mappings import Path, Rule

logger = logging.getLogger(__name__)
Place = Callable[[Path, np.ndarray], Any]
_SUPPORTED_DTYPES = {"F32", "BF16", "F16", "float32", "bfloat16", "float16", mxfp4.PACKED_DTYPE}
# The pre-quantized checkpoints read (dequantized as they stream in); GPTQ, AWQ, bitsandbytes and the rest are not.
READ_QUANTIZATIONS = ("fp8", "mxfp4")


def model_config_of(hf_dir: str | os.PathLike) -> tuple[dict[str, Any], Architecture, Any]:
    """The HF config.json of ``hf_dir``, its architecture and functrain's model config; a quantization_config of a
    method not read here (a pre-quantized GPTQ, AWQ or bitsandbytes checkpoint) is a CheckpointError."""
    hf_config = reader.read_config(hf_dir)
    method = (hf_config.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in READ_QUANTIZATIONS:
        raise CheckpointError(
            f"{hf_dir}: config.json's quantization_config is {method!r}, a pre-quantized checkpoint functrain does "
            f"not read (it reads {' and '.join(READ_QUANTIZATIONS)}); convert the original unquantized weights "
            "(with --base-dtype nf4 to quantize them for QLoRA)"
        )
    arch = architecture_for(hf_config)
    return hf_config, arch, arch.model.from_hf_config(hf_config)


# The shapes of the last few configs: a round trip (read, train, write) asks again for the same model, and tracing
# its init unrolled takes seconds for a large one.
_SHAPES: dict[tuple[str, str], dict[Path, tuple[int, ...]]] = {}
_SHAPES_KEPT = 8


def expected_shapes(arch: Architecture, config: Any) -> dict[Path, tuple[int, ...]]:
    """Shape of every functrain parameter leaf for ``config`` with its layers unrolled (HF's tensors are per
    layer; scanned params convert with ``stacking``), computed abstractly (no memory used)."""
    key = (arch.model_type, config.model_dump_json())
    if key not in _SHAPES:
        module = arch.model.build(config.model_copy(update={"scan_layers": False}))
        abstract = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32)))
        flat = flatten_dict(nn.meta.unbox(abstract["params"]))
        if len(_SHAPES) >= _SHAPES_KEPT:
            del _SHAPES[next(iter(_SHAPES))]  # the oldest
        _SHAPES[key] = {path: leaf.shape for path, leaf in flat.items()}
    return dict(_SHAPES[key])


_EXPERT = re.compile(r"layers\.(\d+)\..*experts\.(\d+)\.")


def _summary(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(_named(name) for name in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _left_out(arch: Architecture, config: Any, names: list[str], where: str) -> None:
    """One log line for each part of the checkpoint the architecture knowingly leaves out (DeepSeek-V3's
    multi-token-prediction layer), naming it and its tensors."""
    parts: dict[str, list[str]] = {}
    for name in names:
        part = arch.mapping.left_out(arch.mapping.canonical_name(name), config)
        if part is not None:
            parts.setdefault(part, []).append(name)
    for part, tensors in parts.items():
        logger.warning(
            "%s: left out %s (%d tensors: %s); functrain's model does not use it", where, part, len(tensors),
            _summary(sorted(tensors), 2),
        )  # fmt: skip


def _named(name: str) -> str:
    """``name``, with the layer and expert it belongs to when it is one expert's tensor."""
    match = _EXPERT.search(name)
    return f"{name} (layer {match.group(1)}, expert {match.group(2)})" if match else name


def _rules_for(arch: Architecture, config: Any, canonical_names: Iterable[str]) -> dict[str, Rule]:
    """The architecture's table, or its fused-experts table when the file holds names only that one has."""
    rules = {rule.hf_name: rule for rule in arch.mapping.rules(config)}
    if arch.mapping.fused_rules is None:
        return rules
    fused = {rule.hf_name: rule for rule in arch.mapping.fused_rules(config)}
    return fused if any(name in fused and name not in rules for name in canonical_names) else rules


def _leaf_shape(rule: Rule, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape the rule's HF tensor fills of a leaf of ``shape``: one expert's entry for an indexed rule."""
    return shape if rule.index is None else shape[1:]


def _match_tensors(
    arch: Architecture, config: Any, infos: dict[str, reader.TensorInfo], where: str, block: tuple[int, int] | None
) -> tuple[dict[str, Rule], dict[Path, tuple[int, ...]], dict[str, str]]:
    """Map each needed file tensor name to its rule, with the shape of every leaf and the scales' name of each
    FP8 weight (``block``: config.json's FP8 block, None when not quantised); CheckpointError on
    missing/unexpected/mis-shaped ones."""
    scales = {name for name in infos if block is not None and name.endswith(fp8.SCALE_SUFFIX)}
    by_canonical = {arch.mapping.canonical_name(name): name for name in infos if name not in scales}
    rules = _rules_for(arch, config, by_canonical)
    unexpected = sorted(
        name
        for canonical, name in by_canonical.items()
        if canonical not in rules
        and not arch.mapping.ignorable(canonical, config)
        and arch.mapping.left_out(canonical, config) is None
        and math.prod(infos[name].shape) > 0  # empty: nothing to convert (n_shared_experts 0 builds 0-wide MLPs)
    )
    unexpected += sorted(name for name in scales if name.removesuffix(fp8.SCALE_SUFFIX) not in infos)
    missing = sorted(name for name in rules if name not in by_canonical)
    if missing or unexpected:
        parts = ([f"missing {_summary(missing)}"] if missing else []) + (
            [f"unexpected {_summary(unexpected)}"] if unexpected else []
        )
        raise CheckpointError(
            f"{where} does not match a {arch.model_type} model with this config.json: "
            f"{'; '.join(parts)}; check config.json or convert a supported checkpoint"
        )
    _left_out(arch, config, list(by_canonical.values()), where)
    shapes = expected_shapes(arch, config)
    needed, scale_of = {}, {}
    for hf_name, rule in rules.items():
        info = infos[by_canonical[hf_name]]
        if fp8.scale_name(info.name) in scales:
            scale_of[info.name] = fp8.scale_name(info.name)
        elif info.dtype not in _SUPPORTED_DTYPES:
            raise CheckpointError(
                f"{info.name} in {info.file.name} has dtype {info.dtype}; only float32, bfloat16 and float16 "
                "weights are supported, and float8 ones with their weight_scale_inv under an fp8 quantization_config"
            )
        got = rule.functrain_shapes(info.shape)
        want = tuple(_leaf_shape(rule, shapes[path]) for path in rule.paths)
        if isinstance(info, mxfp4.PackedInfo):
            mxfp4.check_shape(info, rule.hf_shape(want))
        if got != want:
            raise CheckpointError(
                f"{info.name} has shape {list(info.shape)} but config.json implies "
                f"{list(rule.hf_shape(want))}; config.json does not describe these weights"
            )
        needed[info.name] = rule
    return needed, shapes, scale_of


class _Copies:
    """The leaves several HF tensors fill (a multi-token-prediction layer's copy of the shared embedding): the first
    read is kept until the others are checked equal to it (a CheckpointError naming both when not)."""

    def __init__(self, needed: dict[str, Rule], where: str):
        targets: dict[Path, int] = {}
        for rule in needed.values():
            for path in rule.paths if rule.index is None else ():  # indexed rules fill one entry each
                targets[path] = targets.get(path, 0) + 1
        self.pending = {path: count for path, count in targets.items() if count > 1}
        self.first: dict[Path, tuple[str, np.ndarray]] = {}
        self.where = where

    def seen(self, path: Path, name: str, leaf: np.ndarray) -> bool:
        """Whether ``path`` was filled already (then ``leaf``, from tensor ``name``, is checked against it)."""
        if path not in self.pending:
            return False
        self.pending[path] -= 1
        if path not in self.first:
            self.first[path] = (name, leaf)
            return False
        first, kept = self.first[path] if self.pending[path] else self.first.pop(path)
        if kept.shape != leaf.shape or not np.array_equal(kept, leaf):
            raise CheckpointError(
                f"{self.where}: {name} differs from {first}, but functrain's model holds them as one weight "
                f"({'/'.join(path)}); use a checkpoint whose copies are equal"
            )
        return True


def read_params(hf_dir: str | os.PathLike, place: Place | None = None) -> tuple[dict[str, Any], Any]:
    """Read an HF directory into (functrain params, model config), streaming one tensor at a time.

    ``place(path, array)`` receives each finished leaf (path is a tuple of param keys, array numpy) and
    returns what to store, e.g. a ``jax.Array`` on its target sharding; by default leaves stay numpy.
    Dtypes are kept (bf16 stays bf16); block-quantised FP8 weights become float32 (:mod:`torch_bridge.hf.fp8`).
    """
    hf_config, arch, config = model_config_of(hf_dir)
    weights = reader.find_weights(hf_dir)
    block = fp8.block_shape(hf_config)
    infos = reader.catalog(weights)
    if (hf_config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        infos = mxfp4.unpacked_catalog(infos)
    config = arch.mapping.fit_config(config, {arch.mapping.canonical_name(name) for name in infos})
    needed, shapes, scale_of = _match_tensors(arch, config, infos, str(hf_dir), block)
    packed = {name: info for name, info in infos.items() if isinstance(info, mxfp4.PackedInfo) and name in needed}
    file_names = {part.name for info in packed.values() for part in (info.blocks, info.scales)} | set(needed)
    # FP8: the scales first (one number per block: small), then each weight dequantised as it streams.
    scales = dict(reader.stream(weights, set(scale_of.values())))
    by_weight = {weight: scales[scale] for weight, scale in scale_of.items()}
    tensors = mxfp4.unpacked_stream(reader.stream(weights, file_names), packed)
    if block is not None:
        tensors = fp8.dequantized(tensors, by_weight, block)
    flat: dict[Path, Any] = {}
    stacking: dict[Path, tuple[np.ndarray, set[int]]] = {}  # stacked leaves being filled, expert by expert
    copies = _Copies(needed, str(hf_dir))
    for name, array in tensors:
        rule = needed[name]
        for path, leaf in zip(rule.paths, rule.to_functrain(array)):
            if copies.seen(path, name, leaf):
                continue
            if rule.index is not None:
                stacked, filled = stacking.setdefault(path, (np.empty(shapes[path], leaf.dtype), set()))
                stacked[rule.index] = leaf
                filled.add(rule.index)
                if len(filled) < shapes[path][0]:
                    continue
                leaf = stacking.pop(path)[0]
            flat[path] = leaf if place is None else place(path, leaf)
        del array  # drop the file-order copy before the next read
    return unflatten_dict(flat), config


def place_with_shardings(shardings: Any) -> Place:
    """A ``place`` callable putting each leaf straight onto its ``jax.sharding.Sharding``.

    ``shardings`` is a nested dict shaped like the params (e.g. from the model's logical specs and a mesh).
    """
    by_path = flatten_dict(shardings)
    return lambda path, array: jax.device_put(array, by_path[path])


def load_pretrained(
    path: str | os.PathLike, *, place: Place | None = None, dtype: Any = jnp.float32
) -> tuple[Callable[[Any, Any], jax.Array], dict[str, Any], Any]:
    """Load an HF directory as ``(apply_fn, params, config)``; ``apply_fn(params, input_ids) -> logits``.

    ``dtype`` is the compute dtype of the returned model; logits are always float32.
    """
    params, config = read_params(path, place)
    module = build_model(config, dtype=dtype)

    @jax.jit
    def apply_fn(params: Any, input_ids: Any) -> jax.Array:
        return logits_of(module.apply({"params": params}, input_ids))

    return apply_fn, params, config


def save_pretrained(params: Any, config: Any, out_dir: str | os.PathLike, max_shard_size: str | int = "5GB") -> str:
    """Write ``params`` as an HF directory (config.json + safetensors) that transformers can load.

    Shards are ``model-0000i-of-0000N.safetensors`` plus ``model.safetensors.index.json`` when the
    weights exceed ``max_shard_size``. Returns the output directory path.
    """
    name = config.registry_name() if isinstance(config, ModelConfig) else None
    arch = exported_architecture(name, f"cannot export a {name or type(config).__name__!r} model")
    flat = flatten_dict(unstack_layers(nn.meta.unbox(params)))  # model.scan_layers: one HF tensor per layer
    shapes = expected_shapes(arch, config)
    missing = sorted("/".join(p) for p in shapes if p not in flat)
    unexpected = sorted("/".join(p) for p in flat if p not in shapes)
    wrong = sorted("/".join(p) for p in shapes if p in flat and tuple(np.shape(flat[p])) != shapes[p])
    problems = [
        f"{label} {_summary(paths)}"
        for label, paths in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
        if paths
    ]
    if problems:
        raise CheckpointError(
            f"params do not fit the {arch.model_type} config ({'; '.join(problems)}); "
            "pass the params and config of the same model"
        )
    shard_bytes = writer.parse_size(max_shard_size)
    rules = {rule.hf_name: rule for rule in arch.mapping.rules(config)}
    sizes = {
        name: sum(int(np.prod(_leaf_shape(rule, shapes[p]))) * np.dtype(flat[p].dtype).itemsize for p in rule.paths)
        for name, rule in rules.items()
    }
    dtypes = {np.dtype(leaf.dtype).name for leaf in flat.values()}
    hf_config = arch.model.to_hf_config(config)
    hf_config["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"

    def tensor(name: str) -> np.ndarray:
        rule = rules[name]
        parts = (flat[p] if rule.index is None else flat[p][rule.index] for p in rule.paths)
        return rule.to_hf(tuple(np.asarray(jax.device_get(part)) for part in parts))

    with writer.staged_directory(out_dir) as staging:
        writer.write_hf_dir(staging, hf_config, list(rules), sizes, tensor, shard_bytes)
    return str(os.path.abspath(out_dir))
