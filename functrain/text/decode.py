"""Samples from a language-model run: ``functrain generate RUN_DIR --prompt TEXT``.

Generation is jitted and uses a key/value cache (:mod:`functrain.models.kv_cache`): the prompt is fed once,
then each new token costs one position, so a sample is linear in its length. ``use_cache=False`` recomputes
the whole sequence for every token (the reference the cache is tested and benchmarked against). The key of
token ``i`` is ``fold_in(PRNGKey(seed), i)`` either way, so both paths draw the same tokens.

Prompts are UTF-8 bytes (the ``char_text`` convention: token id = byte) unless an HF tokenizer directory is
given; a prompt that does not fit the model's vocabulary or context is a one-line error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functrain.core.model_output import logits_of
from functrain.errors import ConfigError, DataError
from functrain.models import build_model, family_named, family_names, model_config_class
from functrain.models.configs.base import ModelConfig
from functrain.models.kv_cache import empty_cache, repeated_rows
from functrain.models.options import RuntimeOptions, for_sampling
from functrain.models.stacking import unstack_layers

# The most Gumbel noise generate_ragged draws at once (positions x rows x vocabulary).
NOISE_BLOCK_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Sampling:
    """How to pick each token: greedy at ``temperature == 0``, else softmax sampling at ``temperature``
    from the ``top_k`` most likely tokens (all when None)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value, least in (("max-new-tokens", self.max_new_tokens, 1), ("top-k", self.top_k, 1)):
            if value is not None and value < least:
                raise ConfigError(f"--{name} {value} must be at least {least}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ConfigError(f"--temperature {self.temperature} must be 0 (greedy) or more")


def filtered_logits(logits: jax.Array, temperature: float, top_k: int | None, top_p: float | None) -> jax.Array:
    """The last position's logits [B, vocab] at ``temperature`` (> 0), outside the ``top_k`` most likely tokens and
    then outside the fewest most likely whose probabilities reach ``top_p`` set to -inf (HF's order of the warpers;
    None: no filter)."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        descending = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(descending, axis=-1)
        kept = (jnp.cumsum(probs, axis=-1) - probs < top_p).sum(-1, keepdims=True)  # at least the most likely
        smallest_kept = jnp.take_along_axis(descending, kept - 1, axis=-1)
        logits = jnp.where(logits < smallest_kept, -jnp.inf, logits)
    return logits


def _pick(
    logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None, top_p: float | None = None
) -> jax.Array:
    """The next token ids [B] from the last position's logits [B, vocab]: greedy at temperature 0, else drawn at
    ``temperature`` from the tokens :func:`filtered_logits` keeps."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, temperature, top_k, top_p), axis=-1).astype(jnp.int32)


def first_max_index(values: jax.Array) -> jax.Array:
    """``jnp.argmax`` over the last axis (the first of equal maxima) as two plain reductions, int32: XLA:CPU runs
    argmax's two-operand reduction about 4x slower, and a decoded token pays it every position."""
    top = values.max(axis=-1, keepdims=True)
    last = values.shape[-1] - 1
    return jnp.where(values == top, jnp.arange(last + 1, dtype=jnp.int32), last).min(axis=-1)


def _generate_cached(
    model: Any,
    params: Any,
    prompt: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    batch, prompt_len = prompt.shape
    cache_len = prompt_len + max_new_tokens - 1  # the last new token is returned, never fed back

    def feed(cache: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        output, updated = model.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return logits_of(output)[:, -1], updated["cache"]

    logits, cache = feed(empty_cache(model, params, batch, cache_len), prompt)
    first = _pick(logits, jax.random.fold_in(key, 0), temperature, top_k)

    def one_token(carry: tuple[Any, jax.Array], index: jax.Array) -> tuple[tuple[Any, jax.Array], jax.Array]:
        cache, token = carry
        logits, cache = feed(cache, token[:, None])
        return (cache, _pick(logits, jax.random.fold_in(key, index), temperature, top_k)), token

    (_, last), earlier = jax.lax.scan(one_token, (cache, first), jnp.arange(1, max_new_tokens))
    return jnp.concatenate([earlier.T, last[:, None]], axis=1)


def _generate_uncached(
    model: Any,
    params: Any,
    prompt: jax.Array,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    batch, prompt_len = prompt.shape
    # A fixed-size buffer keeps one compiled step; causal attention never looks at the zeros ahead. The last
    # slot is never fed to the model (the context holds prompt + new tokens - 1, as with the cache).
    tokens = jnp.zeros((batch, prompt_len + max_new_tokens), jnp.int32).at[:, :prompt_len].set(prompt)

    def one_token(index: jax.Array, tokens: jax.Array) -> jax.Array:
        logits = logits_of(model.apply({"params": params}, tokens[:, :-1]))
        current = prompt_len + index
        last = jax.lax.dynamic_index_in_dim(logits, current - 1, axis=1, keepdims=False)
        picked = _pick(last, jax.random.fold_in(key, index), temperature, top_k)
        return jax.lax.dynamic_update_slice(tokens, picked[:, None], (0, current))

    return jax.lax.fori_loop(0, max_new_tokens, one_token, tokens)[:, prompt_len:]


def generate_ragged(
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
) -> tuple[jax.Array, jax.Array]:
    """Prompts of several lengths in one batch, without a padding mask: ``prompts`` [B, W] is right-padded,
    row ``b`` holds ``lengths[b] >= prefill`` tokens. The first ``prefill`` positions are fed at once, then one
    position per step for every row: a row's own prompt token while it lasts (forced), its picked token after.
    Every row attends only to real tokens, so each gets what it would get alone; the last token is returned, never
    fed back (the model sees ``W + max_new_tokens - 1`` positions). Returns the token at each position
    ``prefill .. W + max_new_tokens - 1`` [B, W + max_new_tokens - prefill] and its log-prob under the model's
    distribution at ``temperature`` (before the top-k/top-p filters: the log-prob a training forward computes;
    meaningful where the token was picked, not forced). With ``repeats`` above 1 the rows come in runs of
    ``repeats`` copies of one prompt (GRPO's groups): the first ``prefill`` positions run once per run and their
    cache is repeated over it."""
    batch, width = prompts.shape
    total = width + max_new_tokens

    def feed(cache: Any, tokens: jax.Array) -> tuple[jax.Array, Any]:
        output, updated = model.apply({"params": params, "cache": cache}, tokens, mutable=["cache"])
        return logits_of(output)[:, -1], updated["cache"]

    forced = jnp.pad(prompts, ((0, 0), (0, max_new_tokens)))
    scale = temperature if temperature > 0 else 1.0
    logits, cache = feed(empty_cache(model, params, batch // repeats, total - 1), prompts[::repeats, :prefill])
    logits, cache = repeated_rows((logits, cache), repeats)
    # jax.random.categorical(key, logits) is argmax(logits + gumbel(key)): the Gumbel noise of a block of positions
    # is drawn at once, the numbers each position's key draws alone. XLA:CPU runs threefry as a loop of five small
    # kernels; drawn one position at a time, that loop took about 40% of a decoded token (bench_grpo).
    block = max(1, min(total - prefill, NOISE_BLOCK_BYTES // (batch * logits.shape[-1] * logits.dtype.itemsize)))

    def noise_from(position: jax.Array | int) -> jax.Array:
        keys = jax.vmap(lambda offset: jax.random.fold_in(key, position + offset))(jnp.arange(block))
        return jax.vmap(lambda k: jax.random.gumbel(k, logits.shape, logits.dtype))(keys)

    def pick(logits: jax.Array, position: jax.Array | int, noise: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        if temperature == 0.0:
            picked = first_max_index(logits)
        else:
            offset = (position - prefill) % block
            noise = jax.lax.cond(offset == 0, noise_from, lambda _: noise, position)
            filtered = filtered_logits(logits, temperature, top_k, top_p)
            picked = first_max_index(noise[offset] + filtered)
        token = jnp.where(position < lengths, forced[:, position], picked)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32) / scale, axis=-1)
        return token, jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0], noise

    def one_position(
        carry: tuple[Any, jax.Array, jax.Array], position: jax.Array
    ) -> tuple[tuple[Any, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        cache, logits, noise = carry
        token, logp, noise = pick(logits, position, noise)
        logits, cache = feed(cache, token[:, None])
        return (cache, logits, noise), (token, logp)

    noise = jnp.zeros((block if temperature > 0 else 0, *logits.shape), logits.dtype)
    (_, logits, noise), (tokens, logps) = jax.lax.scan(
        one_position, (cache, logits, noise), jnp.arange(prefill, total - 1)
    )
    last, last_logp, _ = pick(logits, total - 1, noise)
    return jnp.concatenate([tokens.T, last[:, None]], 1), jnp.concatenate([logps.T, last_logp[:, None]], 1)


def _power_of_two_at_most(value: int) -> int:
    return 1 << (value.bit_length() - 1)


_STATIC = ("max_new_tokens", "temperature", "top_k")


class Generator:
    """Jitted generation for one Flax causal LM (compiled once per prompt shape and sampling settings)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._compiled = {
            True: jax.jit(partial(_generate_cached, model), static_argnames=_STATIC),
            False: jax.jit(partial(_generate_uncached, model), static_argnames=_STATIC),
        }
        self._ragged = jax.jit(partial(generate_ragged, model), static_argnames=("prefill", *_STATIC))

    def __call__(self, params: Any, prompt_ids: np.ndarray, sampling: Sampling, use_cache: bool = True) -> np.ndarray:
        """New token ids ``[B, max_new_tokens]`` continuing ``prompt_ids`` ``[B, P]``."""
        prompt = jnp.asarray(np.atleast_2d(prompt_ids), jnp.int32)
        if prompt.shape[1] < 1:
            raise DataError("the prompt is empty; pass at least one character with --prompt")
        if sampling.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens is {sampling.max_new_tokens}; ask for at least 1 token")
        out = self._compiled[use_cache](
            params,
            prompt,
            jax.random.PRNGKey(sampling.seed),
            max_new_tokens=sampling.max_new_tokens,
            temperature=float(sampling.temperature),
            top_k=sampling.top_k,
        )
        return np.asarray(out)

    def ragged(
        self,
        params: Any,
        prompts: list[np.ndarray],
        sampling: Sampling,
        rows: int | None = None,
        context: int | None = None,
    ) -> list[np.ndarray]:
        """New token ids ``[max_new_tokens]`` continuing each of ``prompts`` (of any lengths >= 1), in one
        batch of ``rows`` (default: as many as prompts; more are padded). Batches compile per power-of-two
        width (at most ``context - max_new_tokens`` when given) and shortest prompt, so few shapes compile."""
        lengths = np.array([len(prompt) for prompt in prompts], np.int32)
        if lengths.min() < 1:
            raise DataError("a prompt is empty; give every prompt at least one token")
        width = 1 << (int(lengths.max()) - 1).bit_length()
        if context is not None:
            width = max(min(width, context - sampling.max_new_tokens), int(lengths.max()))
        rows = max(rows or len(prompts), len(prompts))
        padded = np.zeros((rows, width), np.int32)
        for row, prompt in enumerate(prompts):
            padded[row, : len(prompt)] = prompt
        padded[len(prompts) :] = padded[0]
        lengths = np.concatenate([lengths, np.full(rows - len(prompts), lengths[0], np.int32)])
        prefill = _power_of_two_at_most(int(lengths.min()))
        out = np.asarray(
            self._ragged(
                params,
                jnp.asarray(padded),
                jnp.asarray(lengths),
                jax.random.PRNGKey(sampling.seed),
                prefill=prefill,
                max_new_tokens=sampling.max_new_tokens,
                temperature=float(sampling.temperature),
                top_k=sampling.top_k,
            )[0]
        )
        return [
            out[row, length - prefill : length - prefill + sampling.max_new_tokens]
            for row, length in enumerate(lengths[: len(prompts)])
        ]


def generate_tokens(
    model: Any, params: Any, prompt_ids: np.ndarray, sampling: Sampling, use_cache: bool = True
) -> np.ndarray:
    """New token ids ``[B, max_new_tokens]`` continuing ``prompt_ids`` ``[B, P]`` (a Flax causal LM)."""
    return Generator(model)(params, prompt_ids, sampling, use_cache)


def encode_prompt(text: str, vocab_size: int, tokenizer: Any = None) -> np.ndarray:
    """Token ids [P] of ``text``: the tokenizer's, or UTF-8 bytes; ids outside the vocabulary are an error."""
    if tokenizer is not None:
        ids = np.asarray(tokenizer.encode(text), np.int64)
    else:
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64)
    outside = ids >= vocab_size
    if outside.any():
        where = int(np.argmax(outside))
        what = (
            f"token id {ids[where]}"
            if tokenizer is not None
            else f"character {text.encode('utf-8')[where : where + 1]!r} (byte {ids[where]})"
        )
        raise DataError(
            f"the prompt's {what} is outside the model's vocabulary of {vocab_size} ids; use "
            f"characters the model was trained on" + ("" if tokenizer else " or pass --tokenizer")
        )
    return ids


def decode_tokens(ids: np.ndarray, tokenizer: Any = None) -> str:
    """Text of token ids (bytes that are not valid UTF-8 become U+FFFD)."""
    if tokenizer is not None:
        return tokenizer.decode([int(i) for i in ids])
    return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


# Files one of which an HF tokenizer directory holds (the fast tokenizer, its config, or a slow one's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(path: str | os.PathLike, setting: str = "--tokenizer") -> Any:
    """An HF tokenizer from a directory (needs transformers: ``pip install 'functrain[hf]'``). ``setting`` is
    what the user set it with (``--tokenizer``, ``data.tokenizer``, ``eval.samples.tokenizer``), named in errors."""
    where = f"{setting}={str(path)!r}"
    directory = Path(path)
    if directory.is_file():
        raise ConfigError(f"{where} is a file; pass the HF tokenizer directory that holds it ({directory.parent})")
    if not directory.is_dir():
        raise ConfigError(f"{where} does not exist; pass an HF tokenizer directory (one that holds tokenizer.json)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"{where} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); pass the directory an HF "
            f"tokenizer was saved in"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"{setting} needs transformers; pip install 'functrain[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"cannot load a tokenizer from {where} ({reason}); pass an HF tokenizer directory") from None


def load_language_model(run_dir: str | os.PathLike, step: int | None = None) -> tuple[Any, Any, int]:
    """``(flax module, params, step)`` of a causal-LM run's checkpoint (the newest whole one by default)."""
    from functrain.checkpoint import load_params_and_meta

    params, meta = load_params_and_meta(run_dir, step)
    raw_model = meta.get("model")
    if not isinstance(raw_model, dict) or "name" not in raw_model:
        raise ConfigError(
            f"the checkpoint in {run_dir} does not record its model; it was not written by functrain train or convert"
        )
    if meta.get("backend", "jax") != "jax":
        raise ConfigError(
            f"{run_dir} was trained with backend {meta['backend']}; generate and eval read JAX runs "
            f"(and converted HF checkpoints)"
        )
    if not family_named(raw_model["name"]).generation_cache:
        raise ConfigError(
            f"model {raw_model['name']!r} of {run_dir} is not a language model that decodes with a KV cache; "
            f"generate and eval need one ({', '.join(family_names('generation_cache'))})"
        )
    model_config = model_config_class(raw_model["name"]).model_validate(raw_model)
    assert isinstance(model_config, RuntimeOptions), "a causal LM's config has the runtime options"
    from functrain.models.lora import merged_for_inference  # a LoRA run decodes with its adapters merged in

    # The sampling model is unrolled (one KV cache per layer): a scanned run's stacked layers are split.
    return (
        build_model(for_sampling(model_config)),
        unstack_layers(merged_for_inference(params, model_config)),
        int(meta.get("step", step or 0)),
    )


def fitting_new_tokens(prompt_tokens: int, model_config: ModelConfig, wanted: int) -> int:
    """``wanted`` new tokens, or fewer where the model's context ends first (prompt + new - 1 <= context)."""
    limit = model_config.max_positions()
    return wanted if limit is None else min(wanted, limit - prompt_tokens + 1)


def prepare_prompt(ids: np.ndarray, model_config: ModelConfig, max_new_tokens: int) -> np.ndarray:
    """``ids`` checked against the model's context: prompt plus new tokens must fit in it."""
    limit = model_config.max_positions()
    if limit is not None and len(ids) + max_new_tokens - 1 > limit:
        raise ConfigError(
            f"the prompt ({len(ids)} tokens) plus {max_new_tokens} new tokens exceeds the "
            f"model's context of {limit} positions; shorten the prompt or ask for fewer tokens"
        )
    return ids


def sample_text(model: Any, params: Any, prompt: str, sampling: Sampling, tokenizer: Any = None) -> str:
    """The continuation of ``prompt`` as text."""
    ids = prepare_prompt(
        encode_prompt(prompt, model.config.vocab_size, tokenizer), model.config, sampling.max_new_tokens
    )
    return decode_tokens(generate_tokens(model, params, ids[None], sampling)[0], tokenizer)
