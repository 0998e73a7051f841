"""A task ties a model to its loss: classifiers on ``{"x", "y"}`` batches, causal LMs on ``{"tokens"}``.

Loss functions return sums (see :mod:`functrain.step`); every batch carries a per-example ``weight`` that
is 0 for padding, and an LM batch may carry a per-token ``mask``.
"""

from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from functrain.data.validate import BatchCheck, FieldRule
from functrain.models import build_model, model_spec
from functrain.precision import COMPUTE_DTYPES


@dataclass(frozen=True)
class Task:
    """A model with its initialiser and its train/eval losses."""
    model: nn.Module
    kind: str
    example_batch: dict[str, np.ndarray]
    loss_fn: Callable  # (params, batch, rng) -> (loss_sum, weight_sum, aux), dropout on
    eval_loss_fn: Callable  # the same with dropout off

    def init_variables(self, rng: jax.Array) -> dict:
        """The model's variables with logical-axis metadata (``nn.Partitioned`` boxes) on the params."""
        inputs = model_inputs(self.kind, self.example_batch)
        return self.model.init({"params": rng, "dropout": rng}, inputs)

    def init_params(self, rng: jax.Array) -> Any:
        """Plain (unboxed) float32 parameters."""
        return nn.meta.unbox(self.init_variables(rng)["params"])

    def logical_specs(self) -> Any:
        """The parameters' logical axis names as a tree of ``PartitionSpec`` (no arrays are created)."""
        boxed = jax.eval_shape(self.init_variables, jax.random.PRNGKey(0))["params"]
        return nn.get_partition_spec(boxed)


def model_inputs(kind: str, batch: dict) -> Any:
    """The model's input array for a batch of this task kind."""
    return batch["x"] if kind == "classifier" else batch["tokens"][:, :-1]


def classifier_loss(model: nn.Module, deterministic: bool) -> Callable:
    """Softmax cross-entropy on integer labels, weighted per example; aux: correct predictions."""
    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["x"], deterministic=deterministic, rngs={"dropout": rng})
        weight = batch["weight"].astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
        return jnp.sum(losses * weight), jnp.sum(weight), {"accuracy": jnp.sum(correct * weight)}
    return loss_fn


def causal_lm_loss(model: nn.Module, deterministic: bool) -> Callable:
    """Next-token cross-entropy summed over real tokens (``weight`` x optional ``mask``)."""
    def loss_fn(params, batch, rng):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1], deterministic=deterministic,
                             rngs={"dropout": rng})
        targets = tokens[:, 1:]
        mask = batch["weight"].astype(jnp.float32)[:, None] * jnp.ones(targets.shape, jnp.float32)
        if "mask" in batch:
            mask = mask * batch["mask"].astype(jnp.float32)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
        return jnp.sum(losses * mask), jnp.sum(mask), {"accuracy": jnp.sum(correct * mask)}
    return loss_fn


LOSSES = {"classifier": classifier_loss, "causal_lm": causal_lm_loss}


def batch_check(model_config: Any, source: str = "the data") -> BatchCheck:
    """What the built-in loss of ``model_config``'s task kind reads from a batch, with the model's bounds."""
    kind = model_spec(model_config.name)["kind"]
    if kind == "classifier":
        rules = [FieldRule("x", integer=False, what="input"),
                 FieldRule("y", upper=getattr(model_config, "num_classes", None), bound_key="model.num_classes",
                           what="label")]
    else:
        rules = [FieldRule("tokens", upper=getattr(model_config, "vocab_size", None), bound_key="model.vocab_size",
                           what="token id")]
    return BatchCheck(rules, source)


def make_task(config: Any, example_batch: dict[str, np.ndarray]) -> Task:
    """The task for a validated :class:`~functrain.config.Config` and one example host batch."""
    kind = model_spec(config.model.name)["kind"]
    model = build_model(config.model, COMPUTE_DTYPES[config.train.compute_dtype])
    loss = LOSSES[kind]
    return Task(model=model, kind=kind, example_batch=example_batch,
                loss_fn=loss(model, deterministic=False), eval_loss_fn=loss(model, deterministic=True))
