"""The built-in losses: classifiers on ``{"x", "y"}`` batches, causal LMs on ``{"tokens"}``.

Data under other names (``image``/``label``, HF ``input_ids``/``labels``/``attention_mask``, an explicit map)
reaches them renamed by :func:`functrain.core.fields.canonical`. An HF LM batch is ``tokens`` (the
``input_ids``) with optional same-length ``labels`` and ``attention_mask``: the targets are ``labels[:, 1:]``
(HF's shift), and a target counts only where its label is not ``-100`` and its ``attention_mask`` is 1.

Each is a function of the model's logits and the batch returning sums (see :mod:`functrain.core.step`); every
batch carries a per-example ``weight`` that is 0 for padding, and an LM batch may carry a per-token ``mask``.

Packed LM batches may also carry ``segment_ids`` and ``positions``, int32 ``[B, L]`` aligned with ``tokens``
(``positions`` restart at 0 per document): :func:`model_keywords` passes their first ``L - 1`` columns to the
model as keyword arguments (the built-in GPT, GPT-2 and Llama accept them), and :func:`causal_lm_sums` does
not count a target that starts a new segment (it is not predictable from the previous document).
:func:`classifier_loss` and :func:`causal_lm_loss` bind one to a linen module as
``loss_fn(params, batch, rng)``, for research code that calls :func:`functrain.make_train_step` directly.

The policy (which examples and targets count, how the sums are formed) is written once, in
:func:`example_weights`, :func:`target_weights` and :func:`weighted_sums`, with operators jnp arrays and torch
tensors share and the two framework-specific operations passed in as :class:`ArrayOps`; the torch bridge
calls the same functions with its own ops (this module never imports torch).
"""

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import flax.linen as nn
import jax.numpy as jnp
import optax

from functrain.core.fields import Fields
from functrain.core.model_output import add_terms, as_output
from functrain.core.unembedding import LOGITS_CHUNK, LogitsChunk, chunk_positions, chunked_statistics, logits_array
from functrain.data.validate import BatchCheck, FieldRule

# Per-token fields of a packed LM batch that the model takes as keyword arguments.
SEQUENCE_FIELDS = ("segment_ids", "positions")
# The keyword marking an LM's real input tokens, for models that count per-token statistics (a mixture of
# experts' router); a model gets it only when its call names it.
TOKEN_MASK = "token_mask"
# HF's label for a token that carries no loss.
IGNORE_INDEX = -100


def model_inputs(kind: str, batch: dict) -> Any:
    """The model's input array for a batch of this task kind."""
    return batch["x"] if kind == "classifier" else batch["tokens"][:, :-1]


def model_keywords(
    kind: str, batch: dict, ops: "ArrayOps | None" = None, logits_chunk: LogitsChunk = "off"
) -> dict[str, Any]:
    """The model's keyword inputs: a causal LM's ``segment_ids`` / ``positions`` / ``attention_mask`` of its
    input tokens, those the batch has, with ``ops`` its ``token_mask`` (:func:`input_token_mask`), and unless
    ``logits_chunk`` is ``off`` that setting (the model then returns its head unapplied,
    :mod:`functrain.core.unembedding`); ``{}`` otherwise."""
    if kind != "causal_lm":
        return {}
    keywords = {name: batch[name][:, :-1] for name in (*SEQUENCE_FIELDS, "attention_mask") if name in batch}
    if logits_chunk != "off":
        keywords[LOGITS_CHUNK] = logits_chunk
    return keywords if ops is None else {**keywords, TOKEN_MASK: input_token_mask(batch, ops)}


@dataclass(frozen=True)
class ArrayOps:
    """The two array operations the shared loss policy cannot write with common operators."""

    as_float: Callable[[Any], Any]  # cast to float32 (bool, int or float in)
    broadcast_to: Callable[[Any, tuple[int, ...]], Any]


JAX_OPS = ArrayOps(as_float=lambda x: jnp.asarray(x).astype(jnp.float32), broadcast_to=jnp.broadcast_to)


def example_weights(batch: Mapping[str, Any], ops: ArrayOps) -> Any:
    """``[B]``: how much each example counts (its ``weight``; 0 for padding rows)."""
    return ops.as_float(batch["weight"])


def input_token_mask(batch: Mapping[str, Any], ops: ArrayOps) -> Any:
    """``[B, L-1]``: 1 on the real input tokens of an LM batch, 0 on padding (a row of weight 0, a token whose HF
    ``attention_mask`` is 0): what a model's per-token statistics count (an MoE's router)."""
    inputs = batch["tokens"][:, :-1]
    real = ops.broadcast_to(ops.as_float(example_weights(batch, ops) > 0)[:, None], tuple(inputs.shape))
    if "attention_mask" in batch:
        real = real * ops.as_float(batch["attention_mask"][:, :-1] != 0)
    return real


def lm_targets(batch: Mapping[str, Any]) -> Any:
    """``[B, L-1]``: the next-token targets, ``labels[:, 1:]`` (HF) or ``tokens[:, 1:]``, with ``-100`` read as
    0 (any valid id: :func:`target_weights` does not count it, and an out-of-range id would make the
    cross-entropy NaN, which a weight of 0 does not cancel)."""
    targets = batch["labels"][:, 1:] if "labels" in batch else batch["tokens"][:, 1:]
    return targets * (targets != IGNORE_INDEX)


def target_weights(batch: Mapping[str, Any], ops: ArrayOps) -> Any:
    """``[B, L-1]``: how much each next-token target counts: the example's ``weight``, times the optional
    per-target ``mask``, times 0 where the target starts a new segment (``segment_ids``), where its HF label
    is ``-100`` and where its ``attention_mask`` is 0 (padding)."""
    targets = batch["tokens"][:, 1:]
    weights = ops.broadcast_to(example_weights(batch, ops)[:, None], tuple(targets.shape))
    if "labels" in batch:
        weights = weights * ops.as_float(batch["labels"][:, 1:] != IGNORE_INDEX)
    if "attention_mask" in batch:
        weights = weights * ops.as_float(batch["attention_mask"][:, 1:])
    if "mask" in batch:
        weights = weights * ops.as_float(batch["mask"])
    if "segment_ids" in batch:
        segments = batch["segment_ids"]
        weights = weights * ops.as_float(segments[:, 1:] == segments[:, :-1])
    return weights


def weighted_sums(losses: Any, hits: Any, weights: Any, ops: ArrayOps) -> tuple[Any, Any, dict]:
    """``(loss_sum, weight_sum, {"accuracy": hit_sum})`` of per-item ``losses`` and ``hits`` (see
    :func:`label_hits`), each item counted ``weights`` times: sums, never means (the step divides once)."""
    return (losses * weights).sum(), weights.sum(), {"accuracy": (ops.as_float(hits) * weights).sum()}


def label_hits(label_logits: Any, max_logits: Any) -> Any:
    """True where the label's logit is the largest: the prediction is right (a tie at the top counts as right,
    where an argmax would pick the first). Written on the label logit and the row maximum the cross-entropy
    computes anyway, so accuracy costs no second pass over the logits (an argmax over a vocabulary cost a
    train step 2%)."""
    return label_logits >= max_logits


def _jax_hits(logits: Any, labels: Any) -> Any:
    label_logits = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return label_hits(label_logits, jnp.max(logits, axis=-1))


def classifier_sums(logits: Any, batch: dict) -> tuple[Any, Any, dict]:
    """Softmax cross-entropy on integer labels, weighted per example; aux: correct predictions."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    return weighted_sums(losses, _jax_hits(logits, batch["y"]), example_weights(batch, JAX_OPS), JAX_OPS)


def causal_lm_sums(logits: Any, batch: dict) -> tuple[Any, Any, dict]:
    """Next-token cross-entropy summed over real tokens (see :func:`target_weights`); ``logits`` may be an
    :class:`~functrain.core.unembedding.Unembedding`, whose logits are then formed chunk by chunk where they
    would be large."""
    targets = lm_targets(batch)
    chunk = chunk_positions(logits)
    if chunk is None:
        logits = logits_array(logits)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        hits = _jax_hits(logits, targets)
    else:
        label_logits, log_normalisers, max_logits = chunked_statistics(logits, targets, chunk)
        losses, hits = log_normalisers - label_logits, label_hits(label_logits, max_logits)
    return weighted_sums(losses, hits, target_weights(batch, JAX_OPS), JAX_OPS)


LOSSES = {"classifier": classifier_sums, "causal_lm": causal_lm_sums}


def _bound_loss(kind: str, model: nn.Module, deterministic: bool) -> Callable:
    def loss_fn(params, batch, rng):
        keywords = model_keywords(kind, batch, JAX_OPS)
        if TOKEN_MASK not in inspect.signature(type(model).__call__).parameters:
            keywords.pop(TOKEN_MASK, None)
        output = model.apply(
            {"params": params},
            model_inputs(kind, batch),
            deterministic=deterministic,
            rngs={"dropout": rng},
            **keywords,
        )
        output = as_output(output, None)
        loss_sum, weight, aux = LOSSES[kind](output.logits, batch)
        loss_sum, aux = add_terms(output.terms, loss_sum, weight, aux)
        return loss_sum, weight, aux

    return loss_fn


def classifier_loss(model: nn.Module, deterministic: bool) -> Callable:
    """``loss_fn(params, batch, rng)`` of :func:`classifier_sums` on a linen classifier's logits."""
    return _bound_loss("classifier", model, deterministic)


def causal_lm_loss(model: nn.Module, deterministic: bool) -> Callable:
    """``loss_fn(params, batch, rng)`` of :func:`causal_lm_sums` on a linen LM's logits."""
    return _bound_loss("causal_lm", model, deterministic)


class ModelBounds(Protocol):
    """What a batch check asks of the model's config (:class:`functrain.models.configs.base.ModelConfig`)."""

    def class_count(self) -> int | None:
        """Labels lie below it (None: unbounded)."""

    def vocabulary_size(self) -> int | None:
        """Token ids lie below it (None: unbounded)."""


def batch_check(fields: Fields, model_config: ModelBounds, source: str = "the data") -> BatchCheck:
    """What the built-in loss of ``fields`` reads from a batch, with the bounds ``model_config`` gives (if any).
    HF ``labels`` are not range-checked: ``-100`` is theirs by design."""
    if fields.kind == "classifier":
        assert fields.labels is not None, "a classifier's fields name its labels"
        rules = [
            FieldRule(fields.inputs, integer=False, what="input"),
            FieldRule(fields.labels, upper=model_config.class_count(), bound_key="model.num_classes", what="label"),
        ]
    else:
        rules = [
            FieldRule(
                fields.inputs, upper=model_config.vocabulary_size(), bound_key="model.vocab_size", what="token id"
            )
        ]
    return BatchCheck(rules, source)
