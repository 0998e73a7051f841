"""Gemma 4's mixture of experts (``enable_moe_block``), run beside each layer's MLP as transformers'
``Gemma4TextDecoderLayer`` runs it: the router reads the layer's residual (RMS-normalised without a weight, times
its ``scale`` and ``1 / sqrt(hidden)``), takes the top ``top_k_experts`` of a softmax, renormalises their weights
and multiplies each by its expert's ``per_expert_scale``; the experts (a GeGLU each, the stacked weights of
:mod:`functrain.models.moe.layer`) take the residual through ``pre_feedforward_layernorm_2``.

Parameters, in the layer (beside HF's names ``router.*``, ``experts.*``)::

    router/proj/kernel [hidden, E]    router/scale [hidden]    router/per_expert_scale [E]
    experts/{gate,up,down}_proj       [E, hidden, inter] / [E, inter, hidden]
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.configs.gemma4 import Gemma4TextConfig
from functrain.models.hf_common import dense, rms_normalized
from functrain.models.moe.decoder import gated
from functrain.models.moe.dispatch import run_experts
from functrain.models.moe.layer import Experts, RouterStats, router_stats
from functrain.models.moe.routing import Routing, softmax_topk

Array = jax.Array


class Gemma4Router(nn.Module):
    """``router(residual[B, T, hidden]) -> (Routing of the B * T tokens, float32 logits [B * T, E])``."""

    config: Gemma4TextConfig
    dtype: Any

    @nn.compact
    def __call__(self, residual: Array) -> tuple[Routing, Array]:
        cfg = self.config
        hidden, experts = cfg.hidden_size, cfg.expert_count()
        ones = nn.initializers.ones
        scale = self.param("scale", nn.with_logical_partitioning(ones, ("norm",)), (hidden,), jnp.float32)
        per_expert = self.param("per_expert_scale", nn.with_logical_partitioning(ones, (None,)), (experts,))
        normed = rms_normalized(residual, cfg.rms_norm_eps).astype(self.dtype)
        scaled = normed * jnp.asarray(scale, self.dtype) * jnp.asarray(hidden**-0.5, self.dtype)
        logits = dense(
            experts,
            ("embed", None),
            use_bias=False,
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="proj",
            fp8=False,
        )(scaled)  # fmt: skip  (routing in train.compute_dtype)
        logits = logits.astype(jnp.float32).reshape(-1, experts)
        routing = softmax_topk(logits, cfg.experts_per_token(), normalize=True)
        weights = routing.weights * jnp.asarray(per_expert, jnp.float32)[routing.experts]
        return routing._replace(weights=weights), logits


def experts_beside_mlp(
    config: Gemma4TextConfig, dtype: Any, residual: Array, normed: Array, token_mask: Array | None
) -> tuple[Array, RouterStats]:
    """``(the experts' output [B, T, hidden], RouterStats)``: ``residual`` routed, ``normed`` (its
    ``pre_feedforward_layernorm_2``) through the chosen experts. Called inside the layer's compact call, so its
    ``router`` and ``experts`` are the layer's own modules (transformers' names)."""
    batch, length, hidden = residual.shape
    routing, logits = Gemma4Router(config, dtype, name="router")(residual)
    weights = Experts(config.expert_count(), hidden, config.moe_intermediate_size or 0, False,
                      config.initializer_range, name="experts")()  # fmt: skip
    real = jnp.ones((batch, length), jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
    top_k = config.experts_per_token()
    out, dropped = run_experts(
        normed,
        routing.weights.reshape(batch, length, top_k),
        routing.experts.reshape(batch, length, top_k),
        real,
        w=weights,
        glu=gated(config.hidden_activation),
        dispatch=config.moe_dispatch,
        capacity_factor=config.capacity_factor,
    )
    return out.astype(normed.dtype), router_stats(routing, logits, real, dropped)
