"""Paged, shared-prefix, continuous-batching decoding (``grpo.sampler: paged``): the tokens
:func:`functrain.text.decode.generate_ragged` draws for the same keys, without its two costs: a row no longer
decodes its prompt's remainder one position at a time, and a row that drew a stop token stops costing.

- **One pool, a page table** (:mod:`functrain.models.paged_cache`): every layer's keys and values live in pages of
  ``page_size`` positions; a row's page table lists the ``S / page_size`` pages of its cache of ``S = W +
  max_new_tokens - 1`` slots (the dense cache's length: attention sees the same slots and rounds alike).
- **Shared prefix**: each group's prompt (``repeats`` rows in a run, GRPO's G completions) is prefilled once, whole,
  into the group's pages; its rows' tables point at the pages their prompt fills (shared, not copied); the page
  the prompt ends in (if it ends mid-page) is copied into a page of the row's own, which its completion goes on
  writing.
- **Continuous batching with static shapes**: ``slots`` rows (default: all) decode at once, each at its own
  position, in a ``lax.while_loop``. A row takes a free slot from a queue (rows in order), pops its own pages off a
  stack of free pages, draws until a stop id or ``max_new_tokens``, then pushes its pages back and frees its slot
  for the next waiting row. The loop ends when no row is left, so it runs as long as its longest chain of rows
  needs: with fewer slots than rows, the waiting rows fill the slots that rows ending early free; with one slot
  per row, a finished row's slot idles (shapes are static: its row of the model's batch is still computed, on a
  page no row reads) and the loop ends with the last row, before ``max_new_tokens`` if every row stopped.

A row's token at position ``p`` is drawn with the noise that ``generate_ragged`` gives that row at ``p`` (the
Gumbel noise of ``fold_in(key, p)`` over the whole batch, drawn once for every position), so the draws are equal
where the logits are: bitwise with ``model.batch_invariant``, and on the CPU under the sampler's XLA options
(:data:`functrain.tasks.sampling.CONSISTENT_OPTIONS`) for float32 (tests/text/test_paged_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from functrain.core.model_output import logits_of
from functrain.models.kv_cache import empty_cache
from functrain.models.paged_cache import copy_pages, paged_cache, unsupported_leaves, with_rows
from functrain.text.decode import filtered_logits, first_max_index


@dataclass(frozen=True)
class Paging:
    """How :func:`generate_paged` decodes: pages of ``page_size`` positions, ``slots`` rows at once (None: every
    row), a row ending at its first of ``stop_ids``."""

    page_size: int
    slots: int | None = None
    stop_ids: tuple[int, ...] = ()


def default_page_size(cache_length: int, most: int = 16) -> int:
    """The largest page size of at most ``most`` positions that divides ``cache_length``."""
    return max(size for size in range(1, min(most, cache_length) + 1) if cache_length % size == 0)


def unpageable_leaves(model: Any) -> list[str]:
    """The leaves of ``model``'s decoding cache a paged cache has no form for (none: it decodes paged); traced on
    abstract shapes only."""

    def cache() -> Any:
        tokens = jnp.zeros((1, 2), jnp.int32)
        params = model.init(jax.random.PRNGKey(0), tokens)["params"]
        return model.apply({"params": params}, tokens, mutable=["cache"])[1]["cache"]

    return unsupported_leaves(jax.eval_shape(cache))


@dataclass(frozen=True)
class PoolLayout:
    """The pool of one batch: ``groups`` x ``prompt_pages`` pages for the prompts, then ``slots`` x ``own_pages``
    pages for the rows' own (the most a row can need: its prompt is at least ``prefill`` tokens), then one page
    that idle slots write to and no row reads."""

    page_size: int
    pages_per_row: int
    groups: int
    prompt_pages: int
    slots: int
    own_pages: int

    @classmethod
    def of(cls, batch: int, width: int, cache_length: int, prefill: int, repeats: int, page_size: int, slots: int):
        """The layout for ``batch`` rows of prompts at most ``width`` tokens (at least ``prefill``)."""
        pages_per_row = cache_length // page_size
        own = pages_per_row - prefill // page_size
        return cls(page_size, pages_per_row, batch // repeats, -(-width // page_size), min(slots, batch), own)

    @property
    def own_start(self) -> int:
        """The first of the rows' own pages."""
        return self.groups * self.prompt_pages

    @property
    def idle_page(self) -> int:
        """The page idle slots write to."""
        return self.own_start + self.slots * self.own_pages

    def group_pages(self) -> jax.Array:
        """``[groups, prompt_pages]``: the pages each group's prompt is prefilled into."""
        return jnp.arange(self.own_start, dtype=jnp.int32).reshape(self.groups, self.prompt_pages)


class Decoding(NamedTuple):
    """The loop's state: the cache; each slot's page table, row (``batch``: none), tokens drawn, last token
    picked (to feed) and next logits;
    the queue's next row; the stack of free pages and its height; the tokens and log-probs drawn."""

    cache: Any
    table: jax.Array
    slot_row: jax.Array
    drawn: jax.Array
    picked: jax.Array
    logits: jax.Array
    next_row: jax.Array
    free: jax.Array
    top: jax.Array
    tokens: jax.Array
    logps: jax.Array


def _admitted(state: Decoding, layout: PoolLayout, lengths: jax.Array, repeats: int, first_logits: jax.Array):
    """``state`` with its empty slots given the next waiting rows: their tables (the prompt's pages, then pages
    popped off the free stack, the prompt's last partial page copied into the first), their first logits."""
    batch, pages = lengths.shape[0], layout.pages_per_row
    empty = state.slot_row >= batch
    candidate = state.next_row + jnp.cumsum(empty) - 1
    admitted = empty & (candidate < batch)
    rows = jnp.minimum(jnp.where(admitted, candidate, state.slot_row), batch - 1)
    length, group = lengths[rows], rows // repeats
    shared = length // layout.page_size  # the pages the prompt fills
    need = jnp.where(admitted, pages - shared, 0)
    index = jnp.arange(pages)[None]
    popped = state.top - 1 - ((jnp.cumsum(need) - need)[:, None] + index - shared[:, None])
    own = state.free[jnp.clip(popped, 0, state.free.shape[0] - 1)]
    group_pages = layout.group_pages()[group]
    prompt = jnp.take_along_axis(group_pages, jnp.minimum(index, layout.prompt_pages - 1), axis=1)
    table = jnp.where(admitted[:, None], jnp.where(index < shared[:, None], prompt, own), state.table)
    partial = admitted & (length % layout.page_size != 0)
    last_prompt_page = jnp.take_along_axis(group_pages, jnp.minimum(shared, layout.prompt_pages - 1)[:, None], 1)
    first_own = jnp.take_along_axis(table, jnp.minimum(shared, pages - 1)[:, None], 1)[:, 0]
    cache = copy_pages(state.cache, last_prompt_page[:, 0], jnp.where(partial, first_own, layout.idle_page))
    return state._replace(
        cache=cache,
        table=table,
        slot_row=jnp.where(admitted, rows, state.slot_row),
        drawn=jnp.where(admitted, 0, state.drawn),
        logits=jnp.where(admitted[:, None], first_logits[group], state.logits),
        next_row=state.next_row + admitted.sum(),
        top=state.top - need.sum(),
    )


def _freed(state: Decoding, ended: jax.Array, layout: PoolLayout, lengths: jax.Array) -> Decoding:
    """``state`` with the ``ended`` slots' own pages pushed back on the free stack and the slots emptied."""
    batch = lengths.shape[0]
    shared = (lengths[jnp.minimum(state.slot_row, batch - 1)] // layout.page_size)[:, None]
    count = jnp.where(ended, layout.pages_per_row - shared[:, 0], 0)
    index = jnp.arange(layout.pages_per_row)[None]
    pushed = state.top + (jnp.cumsum(count) - count)[:, None] + index - shared
    pushed = jnp.where(ended[:, None] & (index >= shared), pushed, state.free.shape[0])  # out of range: dropped
    return state._replace(
        free=state.free.at[pushed].set(state.table, mode="drop"),
        top=state.top + count.sum(),
        slot_row=jnp.where(ended, batch, state.slot_row),
    )


class _Decoder:
    """The pieces of one paged decode (static settings and the batch's prompts), see :func:`generate_paged`."""

    def __init__(self, model: Any, params: Any, prompts: jax.Array, lengths: jax.Array, settings: dict[str, Any]):
        self.model, self.params, self.prompts, self.lengths = model, params, prompts, lengths
        self.settings = settings
        self.batch, width = prompts.shape
        self.total = width + settings["max_new_tokens"]
        self.layout = PoolLayout.of(
            self.batch,
            width,
            self.total - 1,
            settings["prefill"],
            settings["repeats"],
            settings["page_size"],
            settings["slots"] or self.batch,
        )
        self.idle_row = jnp.full((self.layout.pages_per_row,), self.layout.idle_page, jnp.int32)

    def feed(self, cache: Any, table: jax.Array, positions: jax.Array, tokens: jax.Array) -> tuple[jax.Array, Any]:
        """The logits of ``tokens`` ``[R, T]`` at ``positions`` ``[R]`` on by rows of pages ``table``; the cache."""
        cache = with_rows(cache, table, positions)
        output, updated = self.model.apply({"params": self.params, "cache": cache}, tokens, mutable=["cache"])
        return logits_of(output), updated["cache"]

    def start(self, key: jax.Array) -> tuple[Decoding, jax.Array, jax.Array]:
        """``(state, first logits, noise)``: every group's prompt prefilled into its pages, whole (``[groups, V]``
        the logits after each prompt), every slot idle; the noise of every position (:func:`_noise_table`)."""
        layout, settings, repeats = self.layout, self.settings, self.settings["repeats"]
        pool = paged_cache(
            empty_cache(self.model, self.params, 1, self.total - 1), 1, layout.page_size, layout.idle_page + 1
        )
        prefill_table = (
            jnp.tile(self.idle_row, (layout.groups, 1)).at[:, : layout.prompt_pages].set(layout.group_pages())
        )
        logits, cache = self.feed(pool, prefill_table, jnp.zeros((layout.groups,), jnp.int32), self.prompts[::repeats])
        first = jnp.take_along_axis(logits, (self.lengths[::repeats] - 1)[:, None, None], axis=1)[:, 0]
        prefill, vocab = settings["prefill"], first.shape[-1]
        noise = _noise_table(key, prefill, self.total, vocab, self.batch, first.dtype, settings["temperature"])
        forced = jnp.arange(prefill, self.total)[None] < self.lengths[:, None]
        own = jnp.arange(layout.own_start, layout.idle_page, dtype=jnp.int32)
        idle_table = jnp.broadcast_to(self.idle_row, (layout.slots, layout.pages_per_row))
        slots = jnp.zeros((layout.slots,), jnp.int32)
        state = Decoding(
            cache=with_rows(cache, idle_table, slots),  # the loop's shapes
            table=idle_table,
            slot_row=slots + self.batch,
            drawn=slots,
            picked=slots,
            logits=jnp.zeros((layout.slots, vocab), first.dtype),
            next_row=jnp.zeros((), jnp.int32),
            free=own,
            top=jnp.asarray(own.shape[0], jnp.int32),
            tokens=jnp.where(forced, jnp.pad(self.prompts, ((0, 0), (0, settings["max_new_tokens"])))[:, prefill:], 0),
            logps=jnp.full((self.batch, self.total - prefill), jnp.nan, jnp.float32),
        )
        return state, first, noise

    def picked(self, state: Decoding, noise: jax.Array) -> Decoding:
        """Each busy slot's next token drawn from its logits (recorded with its log-prob); the slots whose row drew
        a stop id or its last token freed."""
        settings, batch = self.settings, self.batch
        temperature, prefill = settings["temperature"], settings["prefill"]
        busy = state.slot_row < batch
        rows = jnp.minimum(state.slot_row, batch - 1)
        position = self.lengths[rows] + state.drawn
        if temperature == 0.0:
            picked = first_max_index(state.logits)
        else:
            filtered = filtered_logits(state.logits, temperature, settings["top_k"], settings["top_p"])
            picked = first_max_index(noise[position - prefill, rows] + filtered)
        scale = temperature if temperature > 0 else 1.0
        log_probs = jax.nn.log_softmax(state.logits.astype(jnp.float32) / scale, axis=-1)
        logp = jnp.take_along_axis(log_probs, picked[:, None], axis=-1)[:, 0]
        at = (jnp.where(busy, rows, batch), position - prefill)  # an idle slot's: dropped
        state = state._replace(
            picked=picked,
            tokens=state.tokens.at[at].set(picked, mode="drop"),
            logps=state.logps.at[at].set(logp, mode="drop"),
        )
        stops = jnp.isin(picked, jnp.asarray(settings["stop_ids"], jnp.int32))
        return _freed(
            state, busy & (stops | (state.drawn == settings["max_new_tokens"] - 1)), self.layout, self.lengths
        )

    def fed(self, state: Decoding) -> Decoding:
        """The busy slots' picked tokens fed at their positions: their next logits; idle slots write the idle page."""
        busy = state.slot_row < self.batch
        positions = self.lengths[jnp.minimum(state.slot_row, self.batch - 1)] + state.drawn
        table = jnp.where(busy[:, None], state.table, self.idle_row)
        tokens = jnp.where(busy, state.picked, 0)[:, None]
        logits, cache = self.feed(state.cache, table, jnp.where(busy, positions, 0), tokens)
        return state._replace(cache=cache, logits=logits[:, -1], drawn=state.drawn + busy)


def generate_paged(
    model: Any,
    params: Any,
    prompts: jax.Array,
    lengths: jax.Array,
    key: jax.Array,
    *,
    prefill: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None = None,
    repeats: int = 1,
    page_size: int,
    slots: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[jax.Array, jax.Array]:
    """:func:`functrain.text.decode.generate_ragged`'s tokens and log-probs ``[B, W + max_new_tokens - prefill]``
    (position ``prefill ..``), decoded as the module says: ``page_size`` divides ``W + max_new_tokens - 1``;
    ``slots`` rows at once (None: all); a row ends at its first of ``stop_ids`` (after it: token 0, log-prob NaN).
    A prompt's own tokens come back with a NaN log-prob (no caller reads them)."""
    settings = dict(
        prefill=prefill,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repeats=repeats,
        page_size=page_size,
        slots=slots,
        stop_ids=stop_ids,
    )
    decoder = _Decoder(model, params, prompts, lengths, settings)
    batch, layout = decoder.batch, decoder.layout
    state, first_logits, noise = decoder.start(key)
    admit = lambda state: _admitted(state, layout, lengths, repeats, first_logits)  # noqa: E731
    state = decoder.picked(admit(state), noise)  # with a slot per row, every row is admitted here, once
    refill = layout.slots < batch

    def step(state: Decoding) -> Decoding:
        state = decoder.fed(state)
        return decoder.picked(admit(state) if refill else state, noise)

    def unfinished(state: Decoding) -> jax.Array:
        return (state.slot_row < batch).any() | (state.next_row < batch)

    state = jax.lax.while_loop(unfinished, step, state)
    return state.tokens, state.logps


def _noise_table(
    key: jax.Array, prefill: int, total: int, vocab: int, batch: int, dtype: Any, temperature: float
) -> jax.Array:
    """``[total - prefill, batch, vocab]``: the Gumbel noise ``generate_ragged`` adds to the batch's logits at each
    position ``prefill ..`` (none at temperature 0)."""
    if temperature == 0.0:
        return jnp.zeros((0, batch, vocab), dtype)
    keys = jax.vmap(lambda position: jax.random.fold_in(key, position))(jnp.arange(prefill, total))
    return jax.vmap(lambda k: jax.random.gumbel(k, (batch, vocab), dtype))(keys)
