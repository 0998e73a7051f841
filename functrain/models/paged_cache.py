"""A paged key/value cache: every attention layer's keys and values in one pool of fixed-size pages, each row's
positions mapped to pages by a page table (``grpo.sampler: paged``, :mod:`functrain.text.paged_decode`).

A dense cache (:mod:`functrain.models.kv_cache`) gives each row ``S`` slots of its own and one position count
for the whole batch. A paged cache gives each layer a pool ``[pages, KV, D, page_size]`` (the dense cache's
``[KV, D, S]`` order, cut into pages), and each row a page table ``[S / page_size]`` of pool pages and a position
of its own: rows at different positions decode in one batch, and rows whose prompt is the same point their
prompt's pages at the same pool pages (shared, never copied). A layer reads a row's keys by gathering its pages,
so it sees the ``S`` slots a dense cache holds, in the same order: attention rounds as it does on a dense cache.

The tree's leaves are the dense cache's, renamed: ``cache_index`` (a scalar) becomes ``row_positions`` ``[B]``,
``cached_key``/``cached_value`` ``[B, KV, D, S]`` become ``key_pages``/``value_pages`` and the layer gets a
``page_table`` ``[B, S / page_size]``. A model whose cache holds anything else (a recurrent state, a latent
cache) has no paged form.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array

DENSE_LEAVES = ("cache_index", "cached_key", "cached_value")


def paged(module: nn.Module) -> bool:
    """True when ``module`` decodes against a paged cache (its cache holds row positions)."""
    return module.has_variable("cache", "row_positions")


def paged_positions(module: nn.Module, length: int) -> Array:
    """``[B, length]``: each row's positions of ``length`` new tokens, after its own; the count advances."""
    start: Array = module.get_variable("cache", "row_positions")
    module.put_variable("cache", "row_positions", start + length)
    return start[:, None] + jnp.arange(length, dtype=jnp.int32)


def paged_extend(module: nn.Module, key: Array, value: Array, positions: Array) -> tuple[Array, Array]:
    """Keys and values ``[B, T, KV, D]`` of the new tokens at ``positions`` ``[B, T]`` written into their rows'
    pages -> each row's whole cache ``[B, S, KV, D]``, gathered from its pages."""
    table: Array = module.get_variable("cache", "page_table")
    page_size: int = module.get_variable("cache", "key_pages").shape[-1]
    pages = jnp.take_along_axis(table, positions // page_size, axis=1)
    offsets = positions % page_size

    def written(name: str, new: Array) -> Array:
        pool: Array = module.get_variable("cache", name)
        pool = pool.at[pages, :, :, offsets].set(new.astype(pool.dtype))
        module.put_variable("cache", name, pool)
        rows = pool[table]  # [B, P, KV, D, page_size]
        batch, count, kv_heads, head_dim, _ = rows.shape
        stored = rows.transpose(0, 2, 3, 1, 4).reshape(batch, kv_heads, head_dim, count * page_size)
        return jnp.transpose(stored, (0, 3, 1, 2))

    return written("key_pages", key), written("value_pages", value)


def unsupported_leaves(shapes: Any) -> list[str]:
    """The names of a dense cache's leaves (its ``jax.ShapeDtypeStruct`` tree) a paged cache has no form for."""
    names = {str(path[-1].key) for path, _ in jax.tree_util.tree_leaves_with_path(shapes)}
    return sorted(names - set(DENSE_LEAVES))


def paged_cache(shapes: Any, rows: int, page_size: int, pages: int) -> Any:
    """A paged cache of zeros for ``rows`` rows from a dense cache's shapes (``S`` a multiple of ``page_size``),
    with a pool of ``pages`` pages per layer; page tables and positions zero (the caller sets them)."""

    def convert(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        converted = {name: convert(child) for name, child in node.items() if name not in DENSE_LEAVES}
        if "cache_index" in node:
            converted["row_positions"] = jnp.zeros((rows,), jnp.int32)
        if "cached_key" in node:
            _, kv_heads, head_dim, slots = node["cached_key"].shape
            for name in ("key_pages", "value_pages"):
                dense = node["cached_" + name.split("_")[0]]
                converted[name] = jnp.zeros((pages, kv_heads, head_dim, page_size), dense.dtype)
            converted["page_table"] = jnp.zeros((rows, slots // page_size), jnp.int32)
        return converted

    return convert(shapes)


def with_rows(cache: Any, table: Array, positions: Array) -> Any:
    """``cache`` with every layer's page table and row positions set to ``table`` and ``positions``."""

    def set_leaf(path: Any, leaf: Array) -> Array:
        name = str(path[-1].key)
        return table if name == "page_table" else positions if name == "row_positions" else leaf

    return jax.tree_util.tree_map_with_path(set_leaf, cache)


def copy_pages(cache: Any, sources: Array, targets: Array) -> Any:
    """``cache`` with pool pages ``sources`` ``[N]`` copied to pages ``targets`` ``[N]`` in every layer."""

    def copy(path: Any, leaf: Array) -> Array:
        if str(path[-1].key) not in ("key_pages", "value_pages"):
            return leaf
        return leaf.at[targets].set(leaf[sources])

    return jax.tree_util.tree_map_with_path(copy, cache)
