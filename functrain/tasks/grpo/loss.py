"""GRPO's loss and its variants, as TRL 1.16's ``GRPOTrainer._compute_loss`` defines them, as sums.

A training batch (made by the experience stage, :mod:`functrain.tasks.grpo.rollout`) holds ``B`` completions:

- ``tokens`` ``[B, L]``: each row its prompt, its completion (EOS included) and padding, right padded;
- ``completion_mask`` ``[B, L]``: 1 on the completion's tokens (0 on every token of a truncated completion with
  ``mask_truncated_completions``);
- ``advantages`` ``[B]``; ``old_logps`` ``[B, L-1]`` (with ``num_iterations`` above 1: the log-probs at the
  generation, position ``t`` scoring token ``t + 1``);
- ``sampler_logps`` ``[B, L-1]``: the sampler's log-probs of the tokens it drew, in the same layout, NaN where it
  drew none;
- ``batch_rows`` and ``batch_tokens`` ``[B]``: the whole batch's completions and completion tokens, on every row,
  so that the sums below divide into TRL's means under accumulation and over devices;
- ``host_metrics`` ``[B, M]``: metrics the stage computed on the host (rewards, lengths), the same on every row.

Per token, with ``logp`` the policy's log-prob of the token at ``temperature`` (TRL divides the logits by it):
``ratio = exp(logp - old_logp)`` (``importance_sampling_level: token``) or ``exp`` of the sequence's mean token
log-ratio (``sequence``, GSPO); the token's loss is ``-min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A)``
plus ``beta`` times the k3 estimator ``exp(ref - logp) - (ref - logp) - 1`` (times the ratio with
``use_bias_correction_kl``, TRL's default, also in the ``kl`` metric). At ``num_iterations: 1`` the old
log-probs are the current ones outside the gradient, so the ratio is exactly 1 (TRL's rule). ``loss_type``:

- ``grpo``: each sequence's mean over its tokens, then the mean over sequences (the weight: sequences);
- ``bnpo`` and ``dapo``: the sum over the batch's completion tokens divided by their number (the weight: tokens).
  TRL's ``bnpo`` divides by each micro-batch's tokens and averages the micro-batches; here the division is once,
  by the whole batch's tokens (``dapo``'s rule), which is the same with one micro-batch per step;
- ``dr_grpo``: the sum over tokens divided by ``B * max_completion_length`` (the weight: sequences).

Metrics, TRL's names: ``kl`` (beta > 0) and ``entropy`` as means over completion tokens; ``clip_ratio/low_mean``,
``clip_ratio/high_mean``, ``clip_ratio/region_mean`` as means over tokens (per sequence with GSPO's ratio);
``clip_ratio/low_min`` and ``clip_ratio/high_max`` as the smallest and largest of the sequences' own means (with
``train.micro_batches`` above 1, the micro-batches' mean of them, as TRL logs them under gradient accumulation).
``rollout/logprob_gap``: the largest absolute difference between the sampler's log-probs and the training
forward's (this step's own at ``num_iterations: 1``, else the old policy's), so that no second forward scores the
drawn tokens; with ``train.micro_batches`` above 1, the sum of the micro-batches' largest (a bound on the largest).

Asynchronous GRPO (``grpo.async_steps``, :mod:`functrain.tasks.grpo.ahead`) samples a batch with weights up to k
steps old: each token's policy loss (not the KL) is then weighted by the importance-sampling ratio of the trained
policy to the sampler, ``min(exp(logp - sampler_logp), async_is_cap)`` outside the gradient (TRL's truncated
importance sampling, ``vllm_importance_sampling_mode: token_truncate``); ``rollout/is_ratio_mean`` is the truncated
ratio's mean over completion tokens and ``rollout/is_clipped_frac`` the share of those the cap truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from functrain.core.adapters import ModelPieces
from functrain.core.model_output import ModelOutput
from functrain.core.program import LossContext, Program, TaskLoss, task_program
from functrain.tasks.reference import reference_of, reference_weights
from functrain.tasks.sampling import token_logps
from functrain.tasks.shared_prefix import SharedPrefixForward, padded_front

# Loss types whose weight (what the step divides by) is the completion tokens; the others divide by sequences.
TOKEN_WEIGHTED = ("bnpo", "dapo")


@dataclass(frozen=True)
class LossSettings:
    """What the loss reads of the ``grpo`` section (TRL's names)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    num_iterations: int = 1
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True
    is_cap: float | None = None  # asynchronous GRPO's truncation of the importance-sampling ratio (None: no ratio)


def grpo_sums(
    settings: LossSettings,
    logps: jax.Array,
    entropies: jax.Array,
    old_logps: jax.Array,
    ref_logps: jax.Array | None,
    batch: dict[str, jax.Array],
    importance: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(loss_sum, weight, metric sums)`` of a (micro-)batch from per-token log-probs ``[B, L-1]`` (see the module
    docstring), each token's policy loss weighted by asynchronous GRPO's truncated importance-sampling ratio when
    ``importance`` (:func:`truncated_is_ratio`) is given; the step divides them once by the whole batch's weight."""
    mask = batch["completion_mask"][:, 1:].astype(jnp.float32)
    advantages = batch["advantages"].astype(jnp.float32)[:, None]
    tokens_per_row = mask.sum(-1)
    log_ratio = logps - old_logps
    if settings.importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / jnp.maximum(tokens_per_row, 1.0))[:, None]
    else:
        log_weights = log_ratio
    ratio = jnp.exp(log_weights)
    clipped = jnp.clip(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    if importance is not None:  # before the KL, as TRL weighs a vLLM sampler's tokens
        per_token = per_token * importance[0]
    if ref_logps is not None:
        gap = ref_logps - logps
        kl = jnp.exp(gap) - gap - 1
        if settings.use_bias_correction_kl:  # the ratio's gradient counts even where its value is exactly 1
            kl = kl * ratio
        per_token = per_token + settings.beta * kl
    masked = (per_token * mask).sum(-1)
    rows = jnp.asarray(mask.shape[0], jnp.float32)
    if settings.loss_type == "grpo":
        loss_sum, weight = (masked / jnp.maximum(tokens_per_row, 1.0)).sum(), rows
    elif settings.loss_type == "dr_grpo":
        loss_sum, weight = masked.sum() / settings.max_completion_length, rows
    else:
        loss_sum, weight = masked.sum(), mask.sum()

    # Metric sums scaled so that the step's division by the whole batch's weight gives TRL's means: over the
    # batch's completion tokens, or over its sequences.
    batch_rows = batch["batch_rows"][0].astype(jnp.float32)
    batch_tokens = jnp.maximum(batch["batch_tokens"][0].astype(jnp.float32), 1.0)
    whole_weight = whole_batch_weight(batch, settings)
    per_token_scale, per_row_scale = whole_weight / batch_tokens, whole_weight / batch_rows

    def token_mean(values: jax.Array) -> jax.Array:
        if values.shape[1] == 1:  # one value per sequence (GSPO's ratio): a mean over sequences, as TRL's
            return values.sum() * per_row_scale
        return (values * mask).sum() * per_token_scale

    def sequence_extreme(values: jax.Array, smallest: bool) -> jax.Array:
        # TRL's nanmin / nanmax over the sequences' means (a sequence without completion tokens is NaN there, left
        # out here; 0 when none has any), scaled so that the micro-batches' values average after the division.
        if values.shape[1] == 1:
            per_row, counted = values[:, 0], jnp.ones(values.shape[0], bool)
        else:
            per_row, counted = (values * mask).sum(-1) / jnp.maximum(tokens_per_row, 1.0), tokens_per_row > 0
        picked = jnp.where(counted, per_row, jnp.inf if smallest else -jnp.inf)
        extreme = jnp.where(counted.any(), picked.min() if smallest else picked.max(), 0.0)
        return extreme * per_row_scale * rows

    low = ((ratio < 1 - settings.epsilon) & (advantages < 0)).astype(jnp.float32)
    high = ((ratio > 1 + settings.epsilon_high) & (advantages > 0)).astype(jnp.float32)
    metrics = {
        "entropy": token_mean(entropies),
        "clip_ratio/low_mean": token_mean(low),
        "clip_ratio/low_min": sequence_extreme(low, smallest=True),
        "clip_ratio/high_mean": token_mean(high),
        "clip_ratio/high_max": sequence_extreme(high, smallest=False),
        "clip_ratio/region_mean": token_mean(jnp.maximum(low, high)),
    }
    if ref_logps is not None:
        metrics["kl"] = token_mean(kl)
    if importance is not None:
        metrics["rollout/is_ratio_mean"] = token_mean(importance[0])
        metrics["rollout/is_clipped_frac"] = token_mean(importance[1])
    return loss_sum, weight, metrics


def truncated_is_ratio(batch: dict[str, jax.Array], logps: jax.Array, cap: float) -> tuple[jax.Array, jax.Array]:
    """``(ratio, truncated)`` ``[B, L-1]``: the importance-sampling ratio of ``logps`` (the trained policy's) to the
    sampler's log-probs of the tokens it drew, at most ``cap``, outside the gradient (1 where it drew none), and 1
    where the cap truncated it."""
    drawn = batch["sampler_logps"].astype(jnp.float32)
    log_ratio = jnp.where(jnp.isnan(drawn), 0.0, jax.lax.stop_gradient(logps) - drawn)
    ratio = jnp.exp(log_ratio)
    return jnp.minimum(ratio, cap), (ratio > cap).astype(jnp.float32)


def whole_batch_weight(batch: dict[str, jax.Array], settings: LossSettings) -> jax.Array:
    """What the step divides the sums by: the whole batch's completion tokens or its sequences."""
    if settings.loss_type in TOKEN_WEIGHTED:
        return jnp.maximum(batch["batch_tokens"][0].astype(jnp.float32), 1.0)
    return batch["batch_rows"][0].astype(jnp.float32)


def host_metric_sums(batch: dict[str, jax.Array], names: tuple[str, ...], settings: LossSettings) -> dict:
    """The stage's host metrics (the same on every row) as sums that the step's division turns back into them."""
    batch_rows = batch["batch_rows"][0].astype(jnp.float32)
    values = batch["host_metrics"].astype(jnp.float32).sum(0) * (whole_batch_weight(batch, settings) / batch_rows)
    return {name: values[index] for index, name in enumerate(names)}


def logprob_gap_sum(batch: dict[str, jax.Array], logps: jax.Array, settings: LossSettings) -> jax.Array:
    """The largest absolute difference between ``logps`` and the sampler's log-probs of the tokens it drew, as a sum
    that the step's division turns back into it."""
    drawn = batch["sampler_logps"].astype(jnp.float32)
    gaps = jnp.where(jnp.isnan(drawn), 0.0, jnp.abs(jax.lax.stop_gradient(logps) - drawn))
    return gaps.max() * whole_batch_weight(batch, settings)


def grpo_task_loss(
    pieces: ModelPieces,
    settings: LossSettings,
    host_metrics: tuple[str, ...],
    shared: SharedPrefixForward | None = None,
) -> TaskLoss:
    """TRL's GRPO loss on a causal LM's log-probs of the completions; with ``beta`` > 0 the reference is the frozen
    base when a transform froze one (LoRA), else a frozen copy of the starting weights
    (:mod:`functrain.tasks.reference`). With ``shared``, the policy's (and the reference's) forward runs each
    group's shared prompt prefix once (:mod:`functrain.tasks.shared_prefix`)."""
    reference = reference_of(pieces.apply, pieces.frozen_apply) if settings.beta > 0 else None
    # Positions before the shared prefix's last score prompt tokens: zeros there (no loss or metric reads them).
    start = 0 if shared is None else shared.prefix.length - 1

    def inputs(batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
        return batch["tokens"][:, :-1], {}

    def score(logits: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        if shared is None:
            return token_logps(logits, batch["tokens"], settings.temperature)
        logps, entropies = token_logps(logits, batch["tokens"][:, start:], settings.temperature)
        return padded_front(logps, start), padded_front(entropies, start)

    def shared_forward(params: Any, model_state: Any, inputs: jax.Array, train: bool, rng: jax.Array) -> ModelOutput:
        assert shared is not None  # the sharing forward has no model state, terms nor dropout (shared_prefix_forward)
        return ModelOutput(shared(params, inputs), None, model_state)

    def reference_logps(context: LossContext, batch: dict[str, jax.Array]) -> jax.Array:
        assert reference is not None
        tokens = batch["tokens"]
        if shared is not None:  # the frozen copy (sharing is off under a transform such as LoRA)
            weights = reference_weights(context.params, context.model_state)
            return jax.lax.stop_gradient(score(shared(weights, tokens[:, :-1]), batch)[0])
        return token_logps(
            reference.logits(context.params, context.model_state, tokens[:, :-1]), tokens, settings.temperature
        )[0]

    def sums(scores: tuple[jax.Array, jax.Array], batch: dict[str, jax.Array], context: LossContext):
        logps, entropies = scores
        entropies = jax.lax.stop_gradient(entropies)
        if settings.num_iterations == 1:
            old_logps = jax.lax.stop_gradient(logps)
        else:
            old_logps = batch["old_logps"].astype(jnp.float32)
        ref_logps = None if reference is None else reference_logps(context, batch)
        importance = None if settings.is_cap is None else truncated_is_ratio(batch, logps, settings.is_cap)
        loss_sum, weight, metrics = grpo_sums(settings, logps, entropies, old_logps, ref_logps, batch, importance)
        metrics["rollout/logprob_gap"] = logprob_gap_sum(batch, old_logps, settings)
        return loss_sum, weight, {**metrics, **host_metric_sums(batch, host_metrics, settings)}

    # With a reference, the policy's forward is rematerialised (run again in the backward, nothing kept), so XLA
    # compiles it as it compiles the reference's plain forward: at the start they are bitwise equal and the KL's
    # gradient is exactly 0 (a last-bit difference gives tokens no other term reaches a gradient of 1e-9, which
    # Adam's first step blows up to a full step). As preference's DPO does. It is then also compiled as the
    # sampler's decoder: rollout/logprob_gap is 0 on CPU where the shapes let XLA:CPU round both alike
    # (functrain.tasks.sampling.CONSISTENT_OPTIONS). Without a reference the forward keeps its activations for the
    # backward, which changes how XLA:CPU fuses and rounds it (a last bit; docs/grpo.md): rematerialising it too
    # would cost bench_grpo.py's step 1.6 of 18.7 ms.
    return TaskLoss(
        inputs,
        sums,
        score=score,
        remat=reference is not None,
        forward=None if shared is None else shared_forward,
        state=None if reference is None else reference.state,
    )


def grpo_program(
    pieces: ModelPieces,
    settings: LossSettings,
    host_metrics: tuple[str, ...],
    shared: SharedPrefixForward | None = None,
) -> Program:
    """The Program of a causal LM's pieces trained on GRPO batches (:func:`grpo_task_loss`)."""
    return task_program(pieces, grpo_task_loss(pieces, settings, host_metrics, shared))
