"""The built-in losses: classifiers on ``{"x", "y"}`` batches, causal LMs on ``{"tokens"}``.

Each is a function of the model's logits and the batch returning sums (see :mod:`functrain.core.step`); every
batch carries a per-example ``weight`` that is 0 for padding, and an LM batch may carry a per-token ``mask``.

Packed LM batches may also carry ``segment_ids`` and ``positions``, int32 ``[B, L]`` aligned with ``tokens``
(``positions`` restart at 0 per document): :func:`model_keywords` passes their first ``L - 1`` columns to the
model as keyword arguments (the built-in GPT, GPT-2 and Llama accept them), and :func:`causal_lm_sums` does
not count a target that starts a new segment (it is not predictable from the previous document).
:func:`classifier_loss` and :func:`causal_lm_loss` bind one to a linen module as
``loss_fn(params, batch, rng)``, for research code that calls :func:`functrain.make_train_step` directly.
"""

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
import optax

from functrain.data.validate import BatchCheck, FieldRule


# Per-token fields of a packed LM batch that the model takes as keyword arguments.
SEQUENCE_FIELDS = ("segment_ids", "positions")


def model_inputs(kind: str, batch: dict) -> Any:
    """The model's input array for a batch of this task kind."""
    return batch["x"] if kind == "classifier" else batch["tokens"][:, :-1]


def model_keywords(kind: str, batch: dict) -> dict[str, Any]:
    """The model's keyword inputs: a causal LM's ``segment_ids`` / ``positions`` of its input tokens, those
    the batch has; ``{}`` otherwise."""
    if kind != "causal_lm":
        return {}
    return {name: batch[name][:, :-1] for name in SEQUENCE_FIELDS if name in batch}


def classifier_sums(logits: Any, batch: dict) -> tuple[Any, Any, dict]:
    """Softmax cross-entropy on integer labels, weighted per example; aux: correct predictions."""
    weight = batch["weight"].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
    correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    return jnp.sum(losses * weight), jnp.sum(weight), {"accuracy": jnp.sum(correct * weight)}


def causal_lm_sums(logits: Any, batch: dict) -> tuple[Any, Any, dict]:
    """Next-token cross-entropy summed over real tokens (``weight`` x optional ``mask``, and within a segment
    when the batch has ``segment_ids``)."""
    targets = batch["tokens"][:, 1:]
    mask = batch["weight"].astype(jnp.float32)[:, None] * jnp.ones(targets.shape, jnp.float32)
    if "mask" in batch:
        mask = mask * batch["mask"].astype(jnp.float32)
    if "segment_ids" in batch:
        segments = batch["segment_ids"]
        mask = mask * (segments[:, 1:] == segments[:, :-1]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask), {"accuracy": jnp.sum(correct * mask)}


LOSSES = {"classifier": classifier_sums, "causal_lm": causal_lm_sums}


def _bound_loss(kind: str, model: nn.Module, deterministic: bool) -> Callable:
    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, model_inputs(kind, batch), deterministic=deterministic,
                             rngs={"dropout": rng}, **model_keywords(kind, batch))
        return LOSSES[kind](logits, batch)
    return loss_fn


def classifier_loss(model: nn.Module, deterministic: bool) -> Callable:
    """``loss_fn(params, batch, rng)`` of :func:`classifier_sums` on a linen classifier's logits."""
    return _bound_loss("classifier", model, deterministic)


def causal_lm_loss(model: nn.Module, deterministic: bool) -> Callable:
    """``loss_fn(params, batch, rng)`` of :func:`causal_lm_sums` on a linen LM's logits."""
    return _bound_loss("causal_lm", model, deterministic)


def infer_task_kind(batch: dict) -> str | None:
    """The built-in loss the data's fields call for: ``causal_lm`` for ``tokens``, ``classifier`` for x/y,
    None for neither."""
    if "tokens" in batch:
        return "causal_lm"
    if "x" in batch and "y" in batch:
        return "classifier"
    return None


def batch_check(kind: str, model_config: Any, source: str = "the data") -> BatchCheck:
    """What the built-in loss of ``kind`` reads from a batch, with the bounds ``model_config`` gives (if any)."""
    if kind == "classifier":
        rules = [FieldRule("x", integer=False, what="input"),
                 FieldRule("y", upper=getattr(model_config, "num_classes", None), bound_key="model.num_classes",
                           what="label")]
    else:
        rules = [FieldRule("tokens", upper=getattr(model_config, "vocab_size", None), bound_key="model.vocab_size",
                           what="token id")]
    return BatchCheck(rules, source)
