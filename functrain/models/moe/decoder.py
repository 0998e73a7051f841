"""A Llama-shaped decoder whose feed-forward a family supplies (a mixture of experts, or a dense MLP on some
layers), returning a :class:`~functrain.core.model_output.ModelOutput`: the logits and every layer's router
statistics. Mixtral, Qwen2-MoE and Qwen3-MoE are this decoder with their config and feed-forward.

``MoeForCausalLM(config, feed_forward)(input_ids[B, T], segment_ids=None, positions=None, token_mask=None)``:
``segment_ids`` / ``positions`` as in :mod:`functrain.models.llama`; ``token_mask`` [B, T] marks the real
tokens whose routing the statistics count (the built-in losses pass it; None: every token). Attention is
Llama's (:class:`functrain.models.llama.LlamaAttention`: the config switches biases, windows and QK-norm) unless
the family passes its own (Llama 4's).

Under a ``context`` mesh axis the layers run on the sequence in load-balanced order
(:mod:`functrain.parallel.context`), the token mask reordered with it: each device routes the tokens it holds, and
the router statistics, sums over tokens, are the same in any order.
"""

import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.core.model_output import ModelOutput
from functrain.models.attention import attention_kernel
from functrain.models.hf_common import RMSNorm, activation, embed, lm_head
from functrain.models.kv_cache import decoding
from functrain.models.llama import LlamaAttention
from functrain.models.moe.balance import Balancing, moe_output
from functrain.models.moe.dispatch import Glu
from functrain.models.moe.layer import RouterStats
from functrain.models.remat import check_remat, remat_block
from functrain.models.scan import apply_layers
from functrain.parallel.context import context_inputs, from_context_order, to_context_order
from functrain.parallel.sharding import constrain_batch

Array = jax.Array
# (config, dtype, layer index, module name) -> the layer's feed-forward: on a layer with experts
# (``config.moe_layer(i)``) a module ``(x[B, T, hidden], token_mask) -> (y, RouterStats)``, else a dense MLP
# ``x -> y``.
FeedForward = Callable[[Any, Any, int, str], nn.Module]


@functools.cache
def gated(hidden_act: str) -> Glu:
    """The gated activation ``act(gate) * up`` of HF's ``hidden_act`` (SwiGLU for ``silu``)."""
    act = activation(hidden_act)
    return lambda gate, up: act(gate) * up


def balancing(config: Any) -> Balancing:
    """The static settings of the balancing terms, from a MoE family's config
    (:class:`functrain.models.configs.moe.MoeOptions`)."""
    return Balancing(
        num_experts=config.expert_count(),
        top_k=config.experts_per_token(),
        aux_coef=config.balancing_coefficient(),
        z_coef=config.router_z_loss_coef,
        scope=config.load_balance_scope,
        capacity=config.capacity_factor is not None,
        moe_layers=tuple(i for i in range(config.num_hidden_layers) if config.moe_layer(i)),
    )


def moe_context_inputs(
    module: nn.Module, input_ids: Array, segment_ids: Array | None, positions: Array | None, token_mask: Array | None
) -> tuple[Array, Array | None, Array | None, Array | None, int]:
    """A MoE decoder's ``[B, T]`` inputs in load-balanced order and the ways the sequence is split
    (:func:`functrain.parallel.context.context_inputs`), the token mask reordered with the tokens."""
    input_ids, segment_ids, positions, ways = context_inputs(input_ids, segment_ids, positions, decoding(module))
    return input_ids, segment_ids, positions, None if token_mask is None else to_context_order(token_mask, ways), ways


class MoeDecoderBlock(nn.Module):
    """One pre-RMSNorm decoder layer: the family's attention (Llama's by default), then its feed-forward
    (``mlp``)."""

    config: Any
    dtype: Any
    layer: int
    feed_forward: FeedForward
    attention: type[nn.Module] = LlamaAttention  # built as attention(config, dtype, layer)

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, token_mask=None):
        eps = self.config.rms_norm_eps
        x = x + self.attention(self.config, self.dtype, self.layer, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), segment_ids, positions
        )
        normed = RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x)
        mlp = self.feed_forward(self.config, self.dtype, self.layer, "mlp")
        if self.config.moe_layer(self.layer):
            y, stats = mlp(normed, token_mask)
        else:
            y, stats = mlp(normed), RouterStats.zeros(self.config.expert_count())
        return x + y, stats


class MoeForCausalLM(nn.Module):
    """``apply({"params": p}, input_ids[B, T]) -> ModelOutput`` (float32 ``.logits`` [B, T, vocab])."""

    config: Any
    feed_forward: FeedForward
    dtype: Any = jnp.float32
    attention: type[nn.Module] = LlamaAttention

    @nn.compact
    def __call__(
        self,
        input_ids,
        deterministic: bool = True,
        *,
        segment_ids=None,
        positions=None,
        token_mask=None,
        logits_chunk=None,
    ) -> ModelOutput:
        """Logits and router statistics for ``input_ids``; ``deterministic`` is accepted for the task interface
        (no dropout here); the keywords: see the module docstring (``logits_chunk``: the head unapplied,
        :mod:`functrain.models.head`)."""
        cfg = self.config
        input_ids, segment_ids, positions, token_mask, ways = moe_context_inputs(
            self, input_ids, segment_ids, positions, token_mask
        )
        tokens = embed(
            cfg.vocab_size,
            cfg.hidden_size,
            ("vocab", "embed"),
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="embed_tokens",
        )
        x = constrain_batch(tokens(input_ids))
        block = remat_block(MoeDecoderBlock, cfg.remat, prevent_cse=not cfg.scan_layers)
        x, stats = apply_layers(
            x,
            kinds=cfg.layer_kinds(),
            make_block=lambda i, name: block(cfg, self.dtype, i, self.feed_forward, self.attention, name=name),
            prefix="layers_",
            scan=cfg.scan_layers,
            args=(segment_ids, positions, token_mask),
            collect=True,
        )
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        x = from_context_order(x, ways)  # the logits in the batch's order, for the loss and every task
        logits = lm_head(self, tokens, x, cfg, cfg.initializer_range, logits_chunk)
        return moe_output(logits, stats, balancing(cfg))


def build_decoder(
    config: Any, feed_forward: FeedForward, dtype: Any = jnp.float32, attention: type[nn.Module] = LlamaAttention
) -> MoeForCausalLM:
    """The decoder for ``config`` computing in ``dtype`` with the layers' ``attention`` (Llama's by default); a
    ConfigError if its attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.attn_head_dim)
    check_remat(config.remat)
    return MoeForCausalLM(config, feed_forward, dtype=dtype, attention=attention)
