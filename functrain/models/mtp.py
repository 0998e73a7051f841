"""DeepSeek-V3's multi-token prediction (its report, section 2.2): ``D`` sequential modules after the main model,
module ``k`` predicting the token ``k + 1`` ahead of each position, trained with their own weighted loss.

With ``h^0`` the main model's final (normed) hidden states and ``t`` the input tokens, module ``k = 1..D`` computes
at each position ``i``::

    h'^k_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      the embedding first, as the released weights do
    h^k    = Block_k(h'^k)                                          a decoder layer of the model's own kind
    P^k_i  = softmax(Head(shared_head_norm(h^k_i)))                 predicts t_{i+k+1}

``Emb`` and ``Head`` are the main model's (shared, as in the report). Position ``i`` of depth ``k`` is trained only
where ``t_{i+k+1}`` is a real token of the same packed segment as ``t_i`` (``segment_ids``, ``token_mask``): a target
never crosses a document boundary or reaches into padding; the block attends within segments as the main layers do,
so a trained position never sees another document either.

The loss (:class:`MtpTerms`): ``mtp_loss_weight / D * sum_k L^k`` with ``L^k`` the mean cross-entropy of depth ``k``
over its trained positions of the whole global batch (the step's totals pass counts them over every micro-batch,
as the global-batch MoE balancing does), logged as ``mtp/loss_d{k}``. Its parameters (HF layer
``num_hidden_layers + k - 1``): ``mtp_layers_{k-1}/{enorm, hnorm, eh_proj, block, shared_head_norm}``.
"""

from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from functrain.models.hf_common import RMSNorm, dense

Array = jax.Array
MTP_PREFIX = "mtp_layers_"
# (depth index, module name) -> the decoder layer of module ``k``: ``(x, segment_ids, positions, token_mask) ->
# (x, per-layer statistics)``; called inside the module that holds it.
MakeBlock = Callable[[int, str], nn.Module]


def shifted(values: Array, shift: int, fill: Any = 0) -> Array:
    """``values[:, i + shift]`` at position ``i`` of ``[B, T, ...]``, ``fill`` past the end."""
    values, shift = jnp.asarray(values), min(shift, values.shape[1])
    tail = jnp.full((values.shape[0], shift, *values.shape[2:]), fill, values.dtype)
    return jnp.concatenate([values[:, shift:], tail], axis=1)


def trained_positions(segment_ids: Array | None, token_mask: Array | None, ahead: int, shape: tuple) -> Array:
    """``[B, T]`` float: 1 where the token ``ahead`` positions on is a real token of the same segment as this
    real one, 0 elsewhere (past the end, across a packed document's boundary, on or into padding)."""
    real = jnp.ones(shape, jnp.float32) if token_mask is None else jnp.asarray(token_mask, jnp.float32)
    keep = real * shifted(real, ahead)
    if segment_ids is not None:
        keep = keep * (shifted(segment_ids, ahead, fill=-1) == segment_ids)
    return keep


class MtpModule(nn.Module):
    """One multi-token-prediction module (depth ``depth + 1``): its two input norms, the projection of their
    concatenation, its decoder layer and the norm before the shared head; returns ``(h^k, the normed h^k, the
    layer's statistics)``."""

    hidden_size: int
    epsilon: float
    init_std: float
    dtype: Any
    depth: int
    make_block: MakeBlock

    @nn.compact
    def __call__(self, previous, next_embeddings, segment_ids, positions, token_mask):
        embeddings = RMSNorm(self.epsilon, self.dtype, name="enorm")(next_embeddings)
        hidden = RMSNorm(self.epsilon, self.dtype, name="hnorm")(previous)
        joined = jnp.concatenate([embeddings, jnp.asarray(hidden, embeddings.dtype)], axis=-1)
        x = dense(self.hidden_size, (None, "embed"), use_bias=False, dtype=self.dtype, init_std=self.init_std,
                  name="eh_proj")(joined)  # fmt: skip
        x, stats = self.make_block(self.depth, "block")(x, segment_ids, positions, token_mask)
        return x, RMSNorm(self.epsilon, self.dtype, name="shared_head_norm")(x), stats


def cross_entropy_sum(logits: Array, targets: Array, keep: Array) -> Array:
    """The summed cross-entropy of float32 ``logits`` [B, T, V] at ``targets`` [B, T] where ``keep``."""
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((jax.nn.logsumexp(logits, axis=-1) - picked) * keep)


@flax.struct.dataclass
class MtpTerms:
    """Multi-token prediction's training terms (:class:`functrain.core.model_output.ModelTerms`): each depth's
    summed cross-entropy over its trained positions and their count, ``[D]``."""

    loss_sums: Array
    counts: Array
    loss_weight: float = flax.struct.field(pytree_node=False)

    @property
    def wants_batch_totals(self) -> bool:
        """Each depth's loss is a mean over the global batch's trained positions: their count is needed first."""
        return True

    def batch_totals(self, weight: Array) -> dict[str, Array]:
        """The task's weight and each depth's trained positions in this forward (no gradient)."""
        return jax.lax.stop_gradient({"weight": weight, "counts": self.counts})

    def loss_terms(self, weight: Array, totals: dict[str, Array] | None) -> tuple[Array, dict[str, Array]]:
        """``mtp_loss_weight`` times the depths' mean loss, scaled so that the step's division by the global weight
        leaves each depth's mean over its trained positions; ``mtp/loss_d{k}`` alike."""
        scope = self.batch_totals(weight) if totals is None else totals
        per_depth = self.loss_sums * scope["weight"] / jnp.maximum(scope["counts"], 1.0)
        metrics = {f"mtp/loss_d{k + 1}": per_depth[k] for k in range(per_depth.shape[0])}
        return self.loss_weight * jnp.mean(per_depth), metrics


def multi_token_prediction(
    hidden: Array,
    *,
    embed: Callable[[Array], Array],
    head: Callable[[Array], Array],
    make_block: MakeBlock,
    inputs: tuple[Array, Array | None, Array | None, Array | None],
    reorder: Callable[[Array], Array],
    config: Any,
    dtype: Any,
) -> tuple[MtpTerms, list[Any]]:
    """The ``config.num_nextn_predict_layers`` modules on the main model's normed final ``hidden`` states, called
    inside the model's compact call: their terms and each layer's statistics.

    ``embed`` / ``head``: the main model's embedding and head (float32 logits); ``inputs``: the batch's
    ``(input_ids, segment_ids, positions, token_mask)`` in its own order; ``reorder``: that order to the layers'
    (a context mesh axis's load-balanced order, else the identity), applied to what is shifted along the sequence.
    """
    input_ids, segment_ids, positions, token_mask = inputs
    layer_segments, layer_positions = (None if x is None else reorder(x) for x in (segment_ids, positions))
    loss_sums, counts, stats = [], [], []
    for k in range(1, config.num_nextn_predict_layers + 1):
        keep = reorder(trained_positions(segment_ids, token_mask, k + 1, input_ids.shape))
        module = MtpModule(config.hidden_size, config.rms_norm_eps, config.initializer_range, dtype, k - 1,
                           make_block, name=f"{MTP_PREFIX}{k - 1}")  # fmt: skip
        hidden, normed, layer_stats = module(
            hidden, embed(reorder(shifted(input_ids, k))), layer_segments, layer_positions, keep
        )
        loss_sums.append(cross_entropy_sum(head(normed), reorder(shifted(input_ids, k + 1)), keep))
        counts.append(jnp.sum(keep))
        stats.append(layer_stats)
    return MtpTerms(jnp.stack(loss_sums), jnp.stack(counts), config.mtp_loss_weight), stats
