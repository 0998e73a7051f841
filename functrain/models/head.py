"""A causal LM's head: its logits, or (called with ``logits_chunk``) the hidden states and the head's weight
unapplied, for a loss that forms the logits chunk by chunk (:mod:`functrain.core.unembedding`).

The untied head stays an ``nn.Dense`` (LoRA adapts Dense layers by intercepting their calls): unapplied, its
kernel is read from the params it created at init, under the same name. The head's product is never FP8
(:mod:`functrain.models.matmul`).
"""

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from functrain.core.unembedding import LogitsChunk, Unembedding, head_logits
from functrain.models.batch_invariant import batch_invariance, batch_invariant
from functrain.models.matmul import unquantized_dot_general

# Names of the untied head modules of functrain's LMs: LoRA on one of them runs the head whole.
HEAD_MODULES = ("head", "lm_head")


def _invariant_product(lhs: Any, rhs: Any, dimension_numbers: Any, precision: Any = None, preferred: Any = None) -> Any:
    """The head's product batch-invariant, wherever the loss traces it (outside the model's call)."""
    with batch_invariance():
        return unquantized_dot_general(lhs, rhs, dimension_numbers, precision, preferred)


def _head_product() -> Callable[..., Any]:
    """The product an unapplied head is formed with: batch-invariant when the model is traced so."""
    return _invariant_product if batch_invariant() else unquantized_dot_general


def untied_head(
    parent: nn.Module,
    x: Any,
    dense: nn.Dense,
    logits_chunk: LogitsChunk | None,
    finish: Callable[[Any], Any] | None = None,
) -> Any:
    """``dense``'s float32 logits of ``x`` (``finish`` applied), or with ``logits_chunk`` an :class:`Unembedding`
    of its kernel; ``parent``: the compact module ``dense`` is declared in."""
    if logits_chunk is None or parent.is_initializing():
        logits = dense(x).astype(jnp.float32)
        return logits if finish is None else finish(logits)
    assert dense.name is not None, "the head is named (its params are read by name)"
    kernel = parent.variables["params"][dense.name]["kernel"]
    hidden = jnp.asarray(x, dense.dtype or kernel.dtype)
    return Unembedding(hidden, kernel, logits_chunk, finish, _head_product())


def tied_head(
    embedding: nn.Embed, x: Any, logits_chunk: LogitsChunk | None, finish: Callable[[Any], Any] | None = None
) -> Any:
    """The float32 logits of ``x`` on the (already called) input ``embedding`` transposed, as ``Embed.attend``
    computes them (``finish`` applied), or with ``logits_chunk`` an :class:`Unembedding` of it."""
    weight = embedding.embedding.T
    hidden = jnp.asarray(x, embedding.dtype or weight.dtype)
    if logits_chunk is None:
        return head_logits(hidden, weight, finish, _head_product())
    return Unembedding(hidden, weight, logits_chunk, finish, _head_product())
