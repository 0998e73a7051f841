"""Preference losses (DPO and its variants), as TRL 1.16 defines them: pure functions of sequence log-probs.

A preference batch holds pairs: ``chosen`` and ``rejected`` token ids ``[B, L]`` (prompt + completion, right
padded) with ``chosen_mask`` / ``rejected_mask`` ``[B, L]`` marking the completion tokens, and the per-pair
``weight`` (0 for padding rows). Chosen and rejected of a pair sit in the same row, so a micro-batch always
holds whole pairs and the step's single division by the total weight is a mean over pairs, exact under
accumulation and across devices.

A sequence's log-prob is the sum over its completion tokens of ``log p(token | tokens before)``; TRL's
``DPOTrainer`` losses (``h`` = chosen log-ratio - rejected log-ratio against the reference model):

- ``sigmoid`` (DPO): ``-log sigmoid(beta h)``;
- ``robust``: ``((1 - e) * -log sigmoid(beta h) - e * -log sigmoid(-beta h)) / (1 - 2e)``, ``e`` =
  ``label_smoothing`` in [0, 0.5);
- ``hinge``: ``relu(1 - beta h)``;
- ``ipo``: ``(h' - 1 / (2 beta))^2`` with ``h'`` of log-ratios averaged over each completion's tokens.

Rewards are ``beta * (logp - ref_logp)``; ``rewards/accuracies`` counts a pair only when the chosen reward is
strictly larger (a tie, as at the first step where the policy is its own reference, counts 0).

Reference-free losses (TRL's experimental ``CPOTrainer`` with ``loss_type="simpo"``, ``ORPOTrainer``), on
log-probs averaged over each completion's tokens, with rewards ``beta * logp``:

- ``simpo``: ``-(1 - e) log sigmoid(beta d - gamma) - e log sigmoid(-(beta d - gamma))``, ``d`` = chosen -
  rejected average log-prob, ``gamma`` = ``simpo_gamma`` (CPO's ``cpo_alpha`` NLL term is not included, as
  TRL recommends ``cpo_alpha=0`` for SimPO);
- ``orpo``: ``NLL(chosen) - beta * log sigmoid(log odds_c - log odds_r)`` with ``log odds = logp -
  log(1 - exp(logp))``; ``beta`` is ORPO's lambda, as in TRL. The NLL is the chosen completion's mean token
  NLL, per pair (TRL averages over all chosen tokens of the batch: the same when completions are equally
  long; per pair keeps accumulation exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import jax
import jax.numpy as jnp

from functrain.core.unembedding import chunk_positions, chunked_statistics, logits_array

if TYPE_CHECKING:  # flax is imported where a program is built, not where the losses are read
    from functrain.core.adapters import Apply, ModelPieces
    from functrain.core.program import LossContext, Program, TaskLoss

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
# The losses whose log-probs are averaged over the completion's tokens before anything else.
LENGTH_AVERAGED = ("simpo", "orpo")
PAIR_FIELDS = ("chosen", "rejected", "chosen_mask", "rejected_mask")
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class PreferenceSettings:
    """The loss and its parameters, named as TRL names them."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares against a reference model."""
        return self.loss_type not in REFERENCE_FREE


def completion_logps(logits: Any, tokens: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of log-probs, token count)`` ``[N]`` of each sequence's completion: ``logits`` ``[N, L-1, V]`` of
    ``tokens[:, :-1]`` (or the model's :class:`~functrain.core.unembedding.Unembedding`, whose logits are then
    formed chunk by chunk where they would be large); position ``t`` predicts token ``t + 1``, counted where
    ``mask[:, t + 1]`` is set."""
    targets, counted = tokens[:, 1:], mask[:, 1:].astype(jnp.float32)
    chunk = chunk_positions(logits)
    if chunk is None:
        log_probs = jax.nn.log_softmax(logits_array(logits).astype(jnp.float32), axis=-1)
        token_logps = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    else:
        label_logits, log_normalisers, _ = chunked_statistics(logits, targets, chunk)
        token_logps = label_logits - log_normalisers
    return (token_logps * counted).sum(-1), counted.sum(-1)


def _log1mexp(x: jax.Array) -> jax.Array:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (TRL's ``log1mexp``)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def pair_losses(
    settings: PreferenceSettings,
    chosen: jax.Array,
    rejected: jax.Array,
    ref_chosen: jax.Array | None,
    ref_rejected: jax.Array | None,
    chosen_count: jax.Array,
    rejected_count: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses, chosen_rewards, rejected_rewards)`` ``[B]`` from summed completion log-probs ``[B]`` of the
    policy and (for the losses that use one) the reference; counts are the completions' token counts."""
    beta, smoothing, loss_type = settings.beta, settings.label_smoothing, settings.loss_type
    # TRL clamps the token count at 1, so a padding row (no tokens) divides by 1, never by 0.
    chosen_count, rejected_count = jnp.maximum(chosen_count, 1.0), jnp.maximum(rejected_count, 1.0)
    if loss_type in REFERENCE_FREE:
        chosen_avg, rejected_avg = chosen / chosen_count, rejected / rejected_count
        if loss_type == "simpo":
            logits = beta * (chosen_avg - rejected_avg) - settings.simpo_gamma
            losses = -(1 - smoothing) * jax.nn.log_sigmoid(logits) - smoothing * jax.nn.log_sigmoid(-logits)
        else:
            log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
            losses = -chosen_avg - beta * jax.nn.log_sigmoid(log_odds)
        return losses, beta * chosen_avg, beta * rejected_avg
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(f"the {loss_type} preference loss compares against a reference; pass its log-probs")
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -jax.nn.log_sigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * delta)
    elif loss_type == "ipo":
        averaged = chosen_ratio / chosen_count - rejected_ratio / rejected_count
        losses = (averaged - 1 / (2 * beta)) ** 2
    elif loss_type == "robust":
        clean = -(1 - smoothing) * jax.nn.log_sigmoid(beta * delta)
        flipped = -smoothing * jax.nn.log_sigmoid(-beta * delta)
        losses = (clean - flipped) / (1 - 2 * smoothing)
    else:
        raise ValueError(f"unknown preference loss {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")
    return losses, beta * chosen_ratio, beta * rejected_ratio


def preference_sums(
    settings: PreferenceSettings, policy: tuple[jax.Array, jax.Array], reference: jax.Array | None, weight: jax.Array
) -> tuple[jax.Array, jax.Array, dict]:
    """``(loss_sum, pair_count, metric sums)`` of a batch of ``B`` pairs: ``policy`` is ``(log-prob sums,
    token counts)`` ``[2B]`` of the chosen rows then the rejected rows, ``reference`` the reference's log-prob
    sums ``[2B]`` (None for the reference-free losses), ``weight`` ``[B]`` per pair. Sums, never means: the
    step divides once by the total weight (the number of real pairs)."""
    logps, counts = policy
    chosen, rejected = jnp.split(logps, 2)
    chosen_count, rejected_count = jnp.split(counts, 2)
    ref_chosen, ref_rejected = (None, None) if reference is None else jnp.split(reference, 2)
    losses, chosen_rewards, rejected_rewards = pair_losses(
        settings, chosen, rejected, ref_chosen, ref_rejected, chosen_count, rejected_count
    )
    if settings.loss_type in LENGTH_AVERAGED:  # TRL logs the log-probs its loss reads
        chosen, rejected = chosen / jnp.maximum(chosen_count, 1.0), rejected / jnp.maximum(rejected_count, 1.0)
    weight = weight.astype(jnp.float32)
    total = lambda values: (values * weight).sum()  # noqa: E731
    aux = {
        "rewards/chosen": total(chosen_rewards),
        "rewards/rejected": total(rejected_rewards),
        "rewards/margins": total(chosen_rewards - rejected_rewards),
        "rewards/accuracies": total((chosen_rewards > rejected_rewards).astype(jnp.float32)),
        "logps/chosen": total(chosen),
        "logps/rejected": total(rejected),
    }
    return total(losses), weight.sum(), aux


def pair_rows(batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    """``(tokens, completion mask)`` ``[2B, L]``: the chosen rows, then the rejected rows."""
    tokens = jnp.concatenate([batch["chosen"], batch["rejected"]])
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
    return tokens, mask


# reference(params, model_state, inputs) -> logits of the frozen reference model.
Reference = Callable[[Any, Any, Any], Any]
# reference_logps(params, model_state, batch) -> the reference's completion log-prob sums [2B].
ReferenceLogps = Callable[[Any, Any, Any], jax.Array]


# TRL's names of the reference's log-prob sums a batch carries when they were computed once before training
# (``preference.precompute_ref``, TRL's ``precompute_ref_log_probs``): float32 ``[B]`` per pair.
REFERENCE_LOGPS = ("ref_chosen_logps", "ref_rejected_logps")


def forward_reference_logps(reference: Reference) -> ReferenceLogps:
    """The reference's log-prob sums ``[2B]`` of a batch from its forward, outside the gradient."""

    def reference_logps(params, model_state, batch):
        tokens, mask = pair_rows(batch)
        logits = jax.lax.stop_gradient(reference(params, model_state, tokens[:, :-1]))
        return completion_logps(logits, tokens, mask)[0]

    return reference_logps


def carried_reference_logps(params, model_state, batch) -> jax.Array:
    """The reference's log-prob sums ``[2B]`` the batch carries (precomputed: no reference forward)."""
    return jnp.concatenate([batch[name] for name in REFERENCE_LOGPS]).astype(jnp.float32)


def preference_task_loss(
    pieces: ModelPieces, settings: PreferenceSettings, *, precompute_reference: bool = False
) -> TaskLoss:
    """The preference loss of a batch of pairs on a causal LM's pieces: one forward of the policy over the chosen
    and rejected rows together, and (losses with a reference) the reference's log-probs: one forward of the
    reference outside the gradient in the same compiled step, or the ones the batch carries.

    The reference is ``pieces.frozen_apply`` on the same params when a transform froze one (LoRA: the model with
    its adapters off, no second copy), else the starting weights. With ``precompute_reference`` its log-probs are
    computed once from the starting state (the same forward as in the step) and the batches carry them
    (:data:`REFERENCE_LOGPS`, computed by :func:`precomputed_reference_logps` before the first step): no reference
    forward in the step and no copy of the weights. They equal the policy's at the first step bitwise with one
    micro-batch per step; with ``train.micro_batches`` the step's forward runs in its accumulation loop, which XLA
    compiles otherwise, and a first-step tie may break in the last bit (the in-step references are computed in the
    same loop, and stay exact). Otherwise, without a frozen base, a frozen copy of the starting weights sits in the
    model state under ``reference`` (:mod:`functrain.tasks.reference`). Reference-free losses hold none.

    The policy's forward is rematerialised: it keeps nothing for the backward, which runs it again (one forward
    more per step), so XLA compiles it as it compiles the reference's plain forward. Equal weights then give
    bitwise equal log-probs, and the first step's rewards are exactly 0 as TRL's are. A forward that keeps its
    activations for the backward is fused otherwise, and XLA's CPU code contracts multiplies and adds into FMAs as
    each fusion's code allows: its last bits differed, so first-step ties broke at random."""
    from functrain.core.program import TaskLoss
    from functrain.tasks.reference import reference_of

    reference_logps: ReferenceLogps | None = None
    state = None
    if settings.uses_reference and precompute_reference:
        reference_logps = carried_reference_logps
    elif settings.uses_reference:
        reference = reference_of(pieces.apply, pieces.frozen_apply)
        reference_logps, state = forward_reference_logps(reference.logits), reference.state

    def inputs(batch: dict[str, Any]) -> tuple[jax.Array, dict]:
        return pair_rows(batch)[0][:, :-1], {}

    def score(logits: Any, batch: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        return completion_logps(logits, *pair_rows(batch))

    def sums(policy: tuple[jax.Array, jax.Array], batch: dict[str, Any], context: LossContext):
        ref_logps = None
        if reference_logps is not None:
            ref_logps = reference_logps(context.params, context.model_state, batch)
        return preference_sums(settings, policy, ref_logps, batch["weight"])

    return TaskLoss(inputs, sums, score=score, remat=True, state=state)


def preference_program(
    pieces: ModelPieces, settings: PreferenceSettings, *, precompute_reference: bool = False
) -> Program:
    """The :class:`~functrain.core.program.Program` of a model's pieces trained on preference pairs
    (:func:`preference_task_loss`)."""
    from functrain.core.program import task_program

    return task_program(pieces, preference_task_loss(pieces, settings, precompute_reference=precompute_reference))


def precomputed_reference_logps(apply: Apply, reference_apply: Apply | None = None) -> Callable:
    """``fn(params, model_state, batch) -> {ref_chosen_logps, ref_rejected_logps}`` ``[B]``: the reference's
    log-prob sums of a batch of pairs, the forward the in-step reference would run (``reference_apply``: the base
    model under LoRA; else the weights given), computed once before training (``preference.precompute_ref``)."""

    def reference(params, model_state, inputs):
        return (reference_apply or apply)(params, model_state, inputs, False, jax.random.PRNGKey(0)).logits

    in_step = forward_reference_logps(reference)

    def precompute(params, model_state, batch):
        return dict(zip(REFERENCE_LOGPS, jnp.split(in_step(params, model_state, batch), 2)))

    return precompute
