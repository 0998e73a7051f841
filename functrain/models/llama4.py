"""Llama 4's language model as a Flax module with the maths of transformers' ``Llama4ForCausalLM``
(``llama4_text``).

Attention: grouped-query heads; on the RoPE layers (``no_rope_layers`` 1) Meta's rotary embedding, whose pairs are
adjacent features, then (``use_qk_norm``) an RMS norm without weights on queries and keys; on the NoPE layers no
rotation and, with ``attn_temperature_tuning``, queries scaled up at long positions. ``chunked_attention`` layers
attend only within their chunk of ``attention_chunk_size`` positions (packed documents' chunks count from each
document's start; decoding masks the cache the same way), ``full_attention`` ones to the whole context.
Feed-forward: on the layers with experts (``moe_layers``) the top ``num_experts_per_tok`` of a sigmoid router, each
taking its token scaled by its router weight, plus an always-on shared expert; Llama's SwiGLU of
``intermediate_size_mlp`` on the others.

The decoder is :class:`functrain.models.moe.decoder.MoeForCausalLM` with this attention and feed-forward: it returns
a :class:`~functrain.core.model_output.ModelOutput` with the experts' statistics.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models import llama
from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.hf import NO_DROPOUT, refuse_unimplemented
from functrain.models.configs.llama4 import Llama4TextConfig
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.hf_common import dense, rms_normalized, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.mla import rotate
from functrain.models.moe.decoder import MoeForCausalLM, build_decoder, gated
from functrain.models.moe.layer import MoeBlock
from functrain.models.moe.routing import sigmoid_topk
from functrain.models.rope import frequencies

Array = jax.Array


def from_hf_config(hf: dict[str, Any]) -> Llama4TextConfig:
    """Llama4TextConfig from an HF config.json dict (old or v5 rope layout); a setting it does not implement is
    named. Per-layer lists longer than the layers are cut as transformers reads them; an empty ``no_rope_layers``
    is transformers' default, a null ``attention_chunk_size`` no chunking."""
    refuse_unimplemented(hf, "llama4_text", NO_DROPOUT)
    hf, layers = dict(hf), hf.get("num_hidden_layers")
    if not hf.get("no_rope_layers"):
        hf.pop("no_rope_layers", None)
    for key in ("no_rope_layers", "layer_types"):
        if isinstance(hf.get(key), list) and isinstance(layers, int):
            hf[key] = hf[key][:layers]
    # A null chunk size is no chunking (not the default chunk a missing key gets).
    null_chunk = "attention_chunk_size" in hf and hf["attention_chunk_size"] is None
    unchunked = {"attention_chunk_size": None} if null_chunk else {}
    return llama.config_from_hf(Llama4TextConfig, hf, **unchunked)


def to_hf_config(config: Llama4TextConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Llama4ForCausalLM (every layer's rope, type and experts written out)."""
    layers = range(config.num_hidden_layers)
    return llama.config_to_hf(
        config,
        "llama4_text",
        "Llama4ForCausalLM",
        exclude={"mlp_bias", *MOE_RUNTIME_KEYS},
        no_rope_layers=[int(config.uses_rope(i)) for i in layers],
        moe_layers=[i for i in layers if config.moe_layer(i)],
        layer_types=list(config.resolved_layer_types()),
    )


def temperature(config: Llama4TextConfig, positions: Array) -> Array:
    """``[B, T]`` scales of the NoPE layers' queries: ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))``."""
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / config.floor_scale)
    return jnp.log1p(steps) * config.attn_scale + 1.0


class Llama4Attention(nn.Module):
    """Llama 4's self-attention (module docstring); Llama's parameter names."""

    config: Llama4TextConfig
    dtype: Any
    layer: int = 0

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.attn_head_dim
        batch, length, _ = x.shape
        std, bias = cfg.initializer_range, cfg.attention_bias

        def project(count: int, axes: tuple[str, str], name: str) -> Array:
            out = dense(count * head_dim, axes, use_bias=bias, dtype=self.dtype, init_std=std, name=name)(x)
            return out.reshape(batch, length, count, head_dim)

        q = project(heads, ("embed", "heads"), "q_proj")
        k = project(kv_heads, ("embed", "kv_heads"), "k_proj")
        v = project(kv_heads, ("embed", "kv_heads"), "v_proj")
        slots = next_positions(self, length)
        token_slots = token_positions(slots, positions, batch)
        if cfg.uses_rope(self.layer):
            inv_freq, rope_scale = frequencies(cfg, slots)
            # Queries and keys come out de-interleaved alike: their dot products are Meta's.
            q, k = (rotate(t, inv_freq, token_slots, rope_scale, interleaved=True) for t in (q, k))
            if cfg.use_qk_norm:
                # transformers' Llama4TextL2Norm: the RMS norm without a weight.
                q, k = (rms_normalized(t, cfg.rms_norm_eps).astype(t.dtype) for t in (q, k))
        elif cfg.attn_temperature_tuning:
            q = (q * temperature(cfg, token_slots)[:, :, None, None]).astype(q.dtype)
        k, v = extend_cache(self, k, v, slots)
        out = attend(
            q,
            k,
            v,
            scale=head_dim**-0.5,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
            chunk=cfg.attention_chunk(self.layer),
        )
        return dense(cfg.hidden_size, ("heads", "embed"), use_bias=bias, dtype=self.dtype, init_std=std, name="o_proj")(
            out.reshape(batch, length, heads * head_dim)
        )


def feed_forward(config: Llama4TextConfig, dtype: Any, layer: int, name: str) -> nn.Module:
    """The layer's experts and shared expert, or Llama's MLP of ``intermediate_size_mlp`` on a dense layer."""
    if not config.moe_layer(layer):
        return llama.LlamaMLP(config, dtype, config.intermediate_size_mlp, name=name)
    return MoeBlock(
        num_experts=config.num_local_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        router=functools.partial(sigmoid_topk, top_k=config.num_experts_per_tok),
        glu=gated(config.hidden_act),
        dispatch=config.moe_dispatch,
        capacity_factor=config.capacity_factor,
        shared_size=config.intermediate_size,
        scale_inputs=True,
        init_std=config.initializer_range,
        dtype=dtype,
        name=name,
    )


def build(config: Llama4TextConfig, dtype: Any = jnp.float32) -> MoeForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32)."""
    return build_decoder(config, feed_forward, dtype, attention=Llama4Attention)
