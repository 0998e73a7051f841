"""Distillation losses: a student's logits against a frozen teacher's, as sums over real tokens.

Per token (summed over the vocabulary), with ``s`` and ``t`` the student's and teacher's log-probabilities of
``logits / temperature``:

- ``forward_kl``: KL(teacher || student), mass-covering;
- ``reverse_kl``: KL(student || teacher), mode-seeking;
- ``jsd``: TRL's generalized Jensen-Shannon divergence (``GKDTrainer.generalized_jsd_loss``, Eq. 1 of
  https://huggingface.co/papers/2306.13649): with the mixture ``m = (1 - beta) * student + beta * teacher``,
  ``beta * KL(teacher || m) + (1 - beta) * KL(student || m)``; at TRL's limits ``beta = 0`` is forward KL and
  ``beta = 1`` reverse KL (the formula itself would vanish there).

As TRL, the divergence is not rescaled by ``temperature ** 2``. :func:`distill_sums` mixes it with the
student's hard-label cross-entropy (at temperature 1): ``alpha * divergence + (1 - alpha) * cross_entropy``,
each token counted where the causal-LM loss counts it (:func:`functrain.core.losses.target_weights`: labels of
``-100``, padding, masks and the first token of a packed segment do not count). Everything is a sum with the
number of counted tokens beside it, so the step's one division is exact over micro-batches and devices.
"""

from typing import Any

import jax
import jax.numpy as jnp

from functrain.core.losses import JAX_OPS, causal_lm_sums, target_weights

# distill.loss -> the generalized JSD's beta it is (None: distill.beta's)
DIVERGENCE_BETA = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": None}


def tempered_log_probs(logits: Any, temperature: float) -> jax.Array:
    """``log_softmax(logits / temperature)`` over the last axis, in float32."""
    return jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1)


def kl_divergence(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """KL(p || q) per row, summed over the last axis, from log-probabilities (torch's
    ``kl_div(log_q, log_p, log_target=True)`` summed over the vocabulary)."""
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def generalized_jsd(student_log_probs: jax.Array, teacher_log_probs: jax.Array, beta: float) -> jax.Array:
    """TRL's generalized JSD per row (see the module docstring); ``beta`` is a Python float in [0, 1]."""
    if beta == 0.0:
        return kl_divergence(teacher_log_probs, student_log_probs)
    if beta == 1.0:
        return kl_divergence(student_log_probs, teacher_log_probs)
    mixture = jnp.logaddexp(student_log_probs + jnp.log1p(-beta), teacher_log_probs + jnp.log(beta))
    return beta * kl_divergence(teacher_log_probs, mixture) + (1.0 - beta) * kl_divergence(student_log_probs, mixture)


def token_divergence(
    student_logits: Any, teacher_logits: Any, *, loss: str, beta: float, temperature: float
) -> jax.Array:
    """``[..., V] -> [...]``: the ``loss`` divergence (``forward_kl``, ``reverse_kl`` or ``jsd`` with ``beta``) of
    each position's tempered distributions."""
    fixed = DIVERGENCE_BETA[loss]
    beta = beta if fixed is None else fixed
    return generalized_jsd(
        tempered_log_probs(student_logits, temperature), tempered_log_probs(teacher_logits, temperature), beta
    )


def distill_sums(
    student_logits: Any, teacher_logits: Any, batch: dict, *, loss: str, beta: float, temperature: float, alpha: float
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(loss_sum, token_count, aux_sums)`` of a causal-LM batch: the mixed loss summed over the counted next-token
    targets, their count, and as sums ``distill`` (the divergence), ``cross_entropy`` (the hard-label loss) and
    ``accuracy`` (the student's top-1 hits). Logits are ``[B, L - 1, V]``, aligned with ``batch["tokens"][:, 1:]``.
    The mix is linear, so it is formed from the two sums."""
    cross_entropy, count, aux = causal_lm_sums(student_logits, batch)
    divergence = token_divergence(student_logits, teacher_logits, loss=loss, beta=beta, temperature=temperature)
    distill = jnp.sum(divergence * target_weights(batch, JAX_OPS))
    mixed = alpha * distill + (1.0 - alpha) * cross_entropy
    return mixed, count, {**aux, "distill": distill, "cross_entropy": cross_entropy}
