"""Routing: which experts each token takes and with what weights, as pure functions of the router's logits.

A router is any ``router(logits[T, E]) -> Routing``; a family builds its own from one of the functions here (or
its own) with its settings bound (``functools.partial``), inside the module's call when it reads model state
(DeepSeek's correction bias). ``Routing.probs`` is what the auxiliary balancing loss averages (transformers'
``load_balancing_loss_func``: the softmax of all the router logits).
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


class Routing(NamedTuple):
    """One layer's routing of ``T`` tokens among ``E`` experts."""

    weights: Array  # [T, k] float32: what each chosen expert's output is multiplied by
    experts: Array  # [T, k] int32: the chosen experts, in the order top_k gives them
    probs: Array  # [T, E] float32: the router's probabilities, for the balancing loss and the metrics


Router = Callable[[Array], Routing]


def softmax_topk(logits: Array, top_k: int, normalize: bool) -> Routing:
    """Softmax over all ``E`` logits, the ``top_k`` largest probabilities, renormalised to sum to one when
    ``normalize`` (Qwen2/3-MoE's ``norm_topk_prob``; Mixtral always, which equals a softmax of the top-k logits)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights, experts.astype(jnp.int32), probs)


def sigmoid_topk(logits: Array, top_k: int) -> Routing:
    """The ``top_k`` largest logits, each expert's weight the sigmoid of its logit (Llama 4's router); the balancing
    loss's probabilities are the softmax of all the logits (transformers' ``load_balancing_loss_func``)."""
    logits = logits.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, top_k)
    return Routing(jax.nn.sigmoid(top), experts.astype(jnp.int32), jax.nn.softmax(logits, axis=-1))
