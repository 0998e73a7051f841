"""The balancing losses and router metrics of a mixture of experts, from the sums its layers return.

With ``c[l, e]`` the selections of expert ``e`` on MoE layer ``l``, ``p[l, e]`` its summed router probability
and ``R = sum_l tokens[l]`` (every MoE layer's real tokens, pooled as transformers pools them):

    aux    = E * sum_e (sum_l c[l, e] / R) * (sum_l p[l, e] / R)      transformers' load_balancing_loss_func
    z_loss = sum_l z[l] / R                                          the mean squared router logsumexp

The training loss adds ``router_aux_loss_coef * aux + router_z_loss_coef * z_loss`` (the first only with
``output_router_logits``, transformers' rule). ``model.load_balance_scope`` picks whose counts ``c`` and ``R``
are: ``micro_batch``, each forward's own; ``global_batch``, the whole global batch's (the step's totals pass).
Since the counts carry no gradient, the global loss is linear in each micro-batch's ``p``: each adds its share
``E * sum_e C_e p_e / R^2`` scaled by the global weight, and the step's one division by that weight gives the
global loss exactly (within float rounding of the ``p`` sums).

Metrics (under ``moe/``, unweighted): ``aux_loss``, ``z_loss``, per MoE layer ``load_max_over_mean/layer_{i}``
(1 is perfect balance, ``E / k`` every token on the same experts) and ``load_entropy/layer_{i}`` (of the load
distribution, in nats: ``log E`` is perfect balance), and ``dropped_fraction`` with a capacity.
"""

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp

from functrain.core.model_output import ModelOutput
from functrain.models.moe.layer import RouterStats

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Balancing:
    """What the balancing terms need from the model's config (static: it rides beside the arrays)."""

    num_experts: int
    top_k: int
    aux_coef: float  # router_aux_loss_coef, 0 without output_router_logits
    z_coef: float
    scope: str  # "micro_batch" | "global_batch"
    capacity: bool  # whether selections can be dropped (a capacity factor is set)
    moe_layers: tuple[int, ...]  # the layers with experts, for the metric names


def _load_metrics(counts: Array) -> tuple[Array, Array]:
    """(max over mean, entropy in nats) of one layer's selection counts [E]."""
    total = jnp.sum(counts)
    mean = total / counts.shape[0]
    share = counts / jnp.maximum(total, 1.0)
    entropy = -jnp.sum(jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)), 0.0))
    return jnp.max(counts) / jnp.maximum(mean, 1e-12), entropy


@flax.struct.dataclass
class MoeTerms:
    """A mixture of experts' training terms (:class:`functrain.core.model_output.ModelTerms`): its layers'
    :class:`RouterStats` stacked ``[L, ...]``, the balancing losses and router metrics they give every task's
    loss."""

    router: RouterStats
    balancing: Balancing = flax.struct.field(pytree_node=False)

    @property
    def wants_batch_totals(self) -> bool:
        """Balanced over the global batch: the counts of every micro-batch are needed first."""
        return self.balancing.scope == "global_batch"

    def batch_totals(self, weight: Array) -> dict[str, Array]:
        """This forward's sums that the terms need globally (no gradient flows through them)."""
        stats = self.router
        totals = {"weight": weight, "counts": stats.counts, "tokens": stats.tokens, "dropped": stats.dropped}
        return jax.lax.stop_gradient(totals)

    def loss_terms(self, weight: Array, totals: dict[str, Array] | None) -> tuple[Array, dict[str, Array]]:
        """``(loss_sum addition, aux sums)``: the balancing losses over the scope's counts, scaled so that the
        step's division by the global weight leaves them as means (module docstring)."""
        settings, stats = self.balancing, self.router
        scope = self.batch_totals(weight) if totals is None else totals
        scale = scope["weight"]  # what the step divides this forward's share by, summed over the scope
        rows = jnp.maximum(jnp.sum(scope["tokens"]), 1.0)
        load = jnp.sum(scope["counts"], axis=0) / rows
        aux = settings.num_experts * jnp.sum(load * jnp.sum(stats.prob_sums, axis=0)) / rows
        z_loss = jnp.sum(stats.z_sums) / rows
        loss_sum = (settings.aux_coef * aux + settings.z_coef * z_loss) * scale
        # Metrics whose every micro-batch computes the scope's whole value count with its own weight's share.
        metrics = {"moe/aux_loss": aux * scale, "moe/z_loss": z_loss * scale}
        for layer in settings.moe_layers:
            max_over_mean, entropy = _load_metrics(scope["counts"][layer])
            metrics[f"moe/load_max_over_mean/layer_{layer}"] = max_over_mean * weight
            metrics[f"moe/load_entropy/layer_{layer}"] = entropy * weight
        if settings.capacity:
            dropped = jnp.sum(scope["dropped"]) / (rows * settings.top_k)
            metrics["moe/dropped_fraction"] = dropped * weight
        return loss_sum, metrics


def moe_output(logits: Array, router: RouterStats, settings: Balancing) -> ModelOutput:
    """A mixture of experts' forward: its logits with its :class:`MoeTerms`."""
    return ModelOutput(logits, MoeTerms(router, settings))
