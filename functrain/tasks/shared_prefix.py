"""One forward (and backward) of the tokens that runs of rows share: GRPO's G completions of a prompt.

A GRPO batch repeats each prompt in ``G`` consecutive rows. A plain forward runs every layer over the prompt ``G``
times, and its backward again; here the prompt's first ``length`` tokens (the file's shortest prompt: every row
has at least that many prompt tokens) but the last run once per group, through the KV cache of the sampling model
(:mod:`functrain.models.kv_cache`): they fill each layer's cache, the cache is repeated ``G`` times, and the rest of
every row (the prefix's last token, its prompt's remainder, its completion, its padding) attends to it as decoding
would, at the same positions as in the plain forward. Gradients flow through the cache back into the prefix's keys
and values, so the gradient is the plain forward's (up to rounding: the prefix's share is summed over the group
once). On ``bench_grpo.py``'s shapes (16 prompt + 32 completion tokens, G = 8) a train step's tokens fall from 1,504
to 1,084 (``bench/README.md``); with long prompts and many generations the saving grows toward ``G`` times the
prompt's share.

The output covers positions ``length - 1 ..`` only (the last prefix position scores a row's first token after
the prefix; the earlier ones score prompt tokens, which no loss reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from functrain.models import build_model
from functrain.models.kv_cache import empty_cache, repeated_rows
from functrain.models.options import for_sampling
from functrain.models.stacking import unstack_layers


@dataclass(frozen=True)
class SharedPrefix:
    """Runs of ``rows`` consecutive rows whose first ``length`` tokens are the same."""

    rows: int
    length: int


class SharedPrefixForward:
    """``forward(params, inputs) -> output`` of a built-in causal LM on ``inputs`` ``[B, T]`` whose rows share
    ``prefix`` (params as the step hands them: cast to the compute dtype, layers scanned or not): the logits
    ``[B, T - length + 1, V]`` of positions ``length - 1 .. T - 1``, or their
    :class:`~functrain.core.unembedding.Unembedding` with ``logits_chunk`` (``length`` at least 2). The model runs
    as the sampler builds it (layers unrolled, no remat, the default kernels)."""

    def __init__(self, model_config: Any, compute_dtype: Any, prefix: SharedPrefix, logits_chunk: Any = None):
        self.model = build_model(for_sampling(model_config), compute_dtype)
        self.prefix = prefix
        self.keywords = {} if logits_chunk in (None, "off") else {"logits_chunk": logits_chunk}

    def __call__(self, params: Any, inputs: jax.Array) -> Any:
        rows, length = self.prefix.rows, self.prefix.length
        weights = unstack_layers(params)
        batch, width = inputs.shape

        def apply(cache: Any, tokens: jax.Array) -> tuple[Any, Any]:
            output, updated = self.model.apply(
                {"params": weights, "cache": cache}, tokens, mutable=["cache"], **self.keywords
            )
            return output, updated["cache"]

        # The prefix's last token runs with the rest of each row (once per row, not per group): its output is then
        # part of the rest's, and the logits come from one product on one array, as the sampler's do (joining the
        # two outputs first left XLA:CPU to compute the final norm apart from the head's product, in its last bit).
        _, cache = apply(empty_cache(self.model, weights, batch // rows, width), inputs[::rows, : length - 1])
        return apply(repeated_rows(cache, rows), inputs[:, length - 1 :])[0]


def padded_front(values: jax.Array, length: int) -> jax.Array:
    """Per-position values ``[B, L - length]`` of positions ``length ..`` as ``[B, L]`` with zeros before them."""
    return jnp.pad(values, ((0, 0), (length, 0)))
