"""DeepSeek-V3's routing and its auxiliary-loss-free balancing, as pure functions.

Routing (HF's ``DeepseekV3TopkRouter``): each expert's score is the sigmoid of its router logit. Selection adds
the per-expert ``e_score_correction_bias`` to the scores, ranks the ``n_group`` groups of experts by the sum of
their two best biased scores, keeps the best ``topk_group`` groups and takes the ``top_k`` best biased scores
within them. The weights are the chosen experts' *unbiased* scores, renormalised to sum to one
(``norm_topk_prob``), times ``routed_scaling_factor``: the bias steers which experts are chosen, never how much
they count.

Balancing (DeepSeek-V3 report, section 2.1.2): after every training step each expert's bias moves by
``bias_update_rate`` towards balance, up when the expert took fewer than the mean selections of its layer over
the step's tokens, down when more: ``bias += rate * sign(mean load - load)``. The loads are the step's total
counts (every micro-batch and device), so the update does not depend on how the batch was split.
"""

import jax
import jax.numpy as jnp

from functrain.models.moe.routing import Routing

Array = jax.Array


def sigmoid_group_limited(
    logits: Array,
    correction_bias: Array,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> Routing:
    """DeepSeek-V3's routing of ``logits`` [T, E] with ``correction_bias`` [E] (module docstring); the
    ``Routing.probs`` are the sigmoid scores."""
    tokens, num_experts = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + correction_bias.astype(jnp.float32)
    grouped = biased.reshape(tokens, n_group, num_experts // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
    best_groups = jax.lax.top_k(group_scores, topk_group)[1]
    kept = jnp.any(best_groups[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [T, n_group]
    eligible = jnp.repeat(kept, num_experts // n_group, axis=1)
    experts = jax.lax.top_k(jnp.where(eligible, biased, -jnp.inf), top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return Routing(weights * scaling, experts.astype(jnp.int32), scores)


def updated_bias(correction_bias: Array, counts: Array, rate: float) -> Array:
    """``correction_bias`` [..., E] after one step whose selections of each expert were ``counts`` [..., E]:
    ``rate`` up for the experts below their layer's mean load, down for those above, unchanged at the mean."""
    mean = jnp.mean(counts, axis=-1, keepdims=True)
    return correction_bias + rate * jnp.sign(mean - counts).astype(correction_bias.dtype)
