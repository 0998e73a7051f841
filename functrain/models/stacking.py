"""Convert parameter trees between the unrolled layer layout and the scanned one (:mod:`functrain.models.scan`).

Unrolled, layer ``i`` lives at ``.../{prefix}{i}/...``; scanned, at ``.../{prefix}stack/slot_{j}/...`` index
``g`` of the leading axis, with ``i = g * period + j`` (``period``: the number of slots). Any tree whose leaves
mirror the params (Adam's ``mu``/``nu``, orbax's saved metadata) converts the same way, so checkpoints, HF
conversion and sampling read either layout. Leaves may be numpy or JAX arrays or ``jax.ShapeDtypeStruct``.
"""

import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from functrain.core.tree import path_string

STACK_SUFFIX = "stack"
SLOT_PREFIX = "slot_"
_STACKED = re.compile(rf"^(.+_){STACK_SUFFIX}$")
_SLOT = re.compile(rf"^{SLOT_PREFIX}(\d+)$")


def flat_paths(tree: Any) -> dict[str, Any]:
    """``{"a/b/c": leaf}`` for every leaf of ``tree`` (dicts, dataclasses, namedtuples alike)."""
    return {path_string(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _stack_position(parts: list[str]) -> int | None:
    """The index of the ``{prefix}stack`` segment of a path split on ``/`` (followed by ``slot_{j}``), or None."""
    return next((k for k in range(len(parts) - 1) if _STACKED.match(parts[k]) and _SLOT.match(parts[k + 1])), None)


def _captured(pattern: re.Pattern[str], part: str) -> str:
    """The group ``pattern`` captures in a path segment :func:`_stack_position` found it to match."""
    match = pattern.match(part)
    assert match is not None, part
    return match.group(1)


def _periods(flat: Mapping[str, Any]) -> dict[str, int]:
    """``{path of a stack: its number of slots}``."""
    periods: dict[str, int] = {}
    for path in flat:
        parts = path.split("/")
        k = _stack_position(parts)
        if k is not None:
            location = "/".join(parts[: k + 1])
            periods[location] = max(periods.get(location, 0), int(_captured(_SLOT, parts[k + 1])) + 1)
    return periods


def _take(leaf: Any, index: int) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(leaf.shape[1:]), leaf.dtype)
    return leaf[index]


def _stack(leaves: list[Any]) -> Any:
    first = leaves[0]
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype)
    return jnp.stack(leaves) if isinstance(first, jax.Array) else np.stack(leaves)


def is_stacked(tree: Any) -> bool:
    """Whether ``tree`` holds scanned (stacked) layers."""
    return bool(_periods(flat_paths(tree)))


def in_stack(path: Sequence[str]) -> bool:
    """Whether the params path ``path`` (its names) lies in a stack of scanned layers: its leaf's leading axis is
    the layers'."""
    return _stack_position(list(path)) is not None


def layer_shape(path: Sequence[str], shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a params leaf at ``path`` has in one layer: a scanned stack's leading axis left out."""
    return tuple(shape[1:]) if in_stack(path) else tuple(shape)


def layer_paths(flat: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{path: the unrolled paths of its layers, in the order of its leading axis}`` for each stacked leaf of
    ``flat`` (``{path: leaf}``; the leaf's leading axis gives the groups)."""
    periods = _periods(flat)
    layers: dict[str, list[str]] = {}
    for path, leaf in flat.items():
        parts = path.split("/")
        k = _stack_position(parts)
        if k is None:
            continue
        prefix, period = _captured(_STACKED, parts[k]), periods["/".join(parts[: k + 1])]
        slot = int(_captured(_SLOT, parts[k + 1]))
        layers[path] = [
            "/".join([*parts[:k], f"{prefix}{group * period + slot}", *parts[k + 2 :]])
            for group in range(np.shape(leaf)[0])
        ]
    return layers


def unstack_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` (``{path: leaf}``) with every stack split into its unrolled layers."""
    layers = layer_paths(flat)
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        if path not in layers:
            out[path] = leaf
            continue
        out.update({unrolled: _take(leaf, group) for group, unrolled in enumerate(layers[path])})
    return out


def relayout_flat(flat: Mapping[str, Any], like: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` in the layer layout of ``like`` (both ``{path: leaf}``; ``like``'s stacked leaves give the group
    counts). Paths ``like`` lacks are kept, layers ``flat`` lacks are left out: a comparison then names them."""
    unrolled = unstack_flat(flat)
    periods = _periods(like)
    out: dict[str, Any] = {}
    used: set[str] = set()
    for path, target in like.items():
        parts = path.split("/")
        k = _stack_position(parts)
        if k is None:
            if path in unrolled:
                out[path] = unrolled[path]
                used.add(path)
            continue
        prefix, period = _captured(_STACKED, parts[k]), periods["/".join(parts[: k + 1])]
        slot = int(_captured(_SLOT, parts[k + 1]))
        sources = [
            "/".join([*parts[:k], f"{prefix}{group * period + slot}", *parts[k + 2 :]])
            for group in range(target.shape[0])
        ]
        if all(source in unrolled for source in sources):
            out[path] = _stack([unrolled[source] for source in sources])
            used.update(sources)
    out.update({path: leaf for path, leaf in unrolled.items() if path not in used and path not in out})
    return out


def _nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, name = path.split("/")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = leaf
    return tree


def unstack_layers(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """A nested dict of params with every stack split into unrolled layers (unchanged when none is stacked)."""
    flat = flat_paths(params)
    return _nested(unstack_flat(flat)) if _periods(flat) else params


def relayout_like(tree: Any, like: Any) -> Any:
    """``tree`` converted to the layer layout and the structure of ``like`` (a tree of the same model, scanned
    or not: its leaves give the shapes); a KeyError names a leaf ``tree`` cannot provide."""
    flat = relayout_flat(flat_paths(tree), flat_paths(like))
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_string(path)] for path, _ in paths])


def _stack_sizes(flat: Mapping[str, Any]) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(parent path, layer prefix): (period, groups)}`` for each stack of ``flat`` (``{path: leaf}``)."""
    periods = _periods(flat)
    sizes: dict[tuple[str, str], tuple[int, int]] = {}
    for path, leaf in flat.items():
        parts = path.split("/")
        k = _stack_position(parts)
        if k is not None:
            location = "/".join(parts[: k + 1])
            sizes["/".join(parts[:k]), _captured(_STACKED, parts[k])] = (periods[location], np.shape(leaf)[0])
    return sizes


def _stacked_place(path: str, sizes: Mapping[tuple[str, str], tuple[int, int]]) -> tuple[str, int] | None:
    """Where the unrolled ``path`` goes in the stacks ``sizes`` describes: ``(stacked path, group)``, or None."""
    for (parent, prefix), (period, groups) in sizes.items():
        head = f"{parent}/" if parent else ""
        match = re.match(rf"^{re.escape(head + prefix)}(\d+)/(.+)$", path)
        if match and int(match.group(1)) < period * groups:
            layer = int(match.group(1))
            stacked = f"{head}{prefix}{STACK_SUFFIX}/{SLOT_PREFIX}{layer % period}/{match.group(2)}"
            return stacked, layer // period
    return None


def relayout_layers(tree: Mapping[str, Any], like: Any) -> dict[str, Any]:
    """``tree`` (a nested dict of params) in the layer layout of ``like`` (params of the same model, scanned or
    not), whatever leaves ``tree`` holds beside ``like``'s (a LoRA run's adapters, a quantized base's codes): each
    of its leaves under one of ``like``'s stacked layers is stacked there, the others are unrolled."""
    sizes, flat = _stack_sizes(flat_paths(like)), flat_paths(tree)
    stacks = _stack_sizes(flat)
    if all(stacks[key] == sizes.get(key) for key in stacks) and not any(_stacked_place(p, sizes) for p in flat):
        return dict(tree)  # already in that layout: nothing copied
    out: dict[str, Any] = {}
    grouped: dict[str, dict[int, Any]] = {}
    for path, leaf in unstack_flat(flat).items():
        place = _stacked_place(path, sizes)
        if place is None:
            out[path] = leaf
        else:
            grouped.setdefault(place[0], {})[place[1]] = leaf
    out.update({path: _stack([layers[group] for group in sorted(layers)]) for path, layers in grouped.items()})
    return _nested(out)
