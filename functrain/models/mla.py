"""Multi-head latent attention (DeepSeek-V2/V3) with the maths of HF's ``DeepseekV3Attention``.

Queries come from the hidden state directly (``q_proj``) or through a low-rank bottleneck (``q_a_proj``, an
RMSNorm, ``q_b_proj``: ``q_lora_rank``). Keys and values share one compressed latent per token: ``kv_a_proj_with_mqa``
maps the hidden state to ``kv_lora_rank`` latent features (RMS-normalised) plus ``qk_rope_head_dim`` features of
one rotary key shared by every head; ``kv_b_proj`` expands the latent into each head's un-rotated key
(``qk_nope_head_dim``) and value (``v_head_dim``). A query head is its un-rotated part then its rotated part;
the softmax scale is ``qk_head_dim ** -0.5`` times YaRN's ``mscale(factor, mscale_all_dim) ** 2``.

Decoding caches what DeepSeek caches: the normalised latent ``[B, S, kv_lora_rank]`` and the rotated shared key
``[B, S, qk_rope_head_dim]`` (not per-head keys and values: 576 numbers a token for DeepSeek-V3 where expanded
keys and values would hold 40,960). The new queries attend to the cache in the latent space: ``kv_b_proj``'s key
half is absorbed into the queries and its value half applied after the softmax, which computes the same as
expanding the cache (DeepSeek's "absorb" inference) at a cost that does not multiply the cache by the heads.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.deepseek_v3 import DeepseekV3Config
from functrain.models.hf_common import RMSNorm, dense, token_positions
from functrain.models.kv_cache import cached, decoding, next_positions
from functrain.models.rope import apply_rope, frequencies, yarn_mscale

Array = jax.Array
# HF builds the latent norms with RMSNorm's default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def softmax_scale(config: DeepseekV3Config) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (HF's
    ``yarn_apply_mscale``: the attention temperature of a longer context)."""
    scale = config.qk_head_dim**-0.5
    scaling = config.rope_scaling
    if scaling is not None and scaling.mscale_all_dim:
        assert scaling.factor is not None, "set: RopeScaling requires a factor where mscale_all_dim is allowed"
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def rotate(x: Array, inv_freq: Any, positions: Array, scale: float, interleaved: bool) -> Array:
    """RoPE on ``x`` [B, T, H, D]. DeepSeek's rotary pairs are adjacent features ``(x0, x1), (x2, x3), ...``
    (``rope_interleave``); HF computes them de-interleaved (evens then odds) and rotate-half, and so do we: the
    output is in that layout for queries and keys alike, so their dot products are DeepSeek's."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, inv_freq, positions, scale)


def _widened(x: Array, width: int) -> Array:
    """``x`` zero-padded on its last axis to ``width`` (attention kernels take one head width for q, k and v;
    zero features change neither scores nor outputs)."""
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (module docstring); parameter names mirror HF's."""

    config: DeepseekV3Config
    dtype: Any

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None = None, positions: Array | None = None) -> Array:
        cfg = self.config
        batch, length, _ = x.shape
        heads, nope, rope_dim, rank = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.kv_lora_rank,
        )

        def linear(features: int, axes: tuple[str, str], name: str, bias: bool = False) -> nn.Dense:
            return dense(features, axes, use_bias=bias, dtype=self.dtype, init_std=cfg.initializer_range, name=name)

        if cfg.q_lora_rank is None:
            q = linear(heads * cfg.qk_head_dim, ("embed", "heads"), "q_proj")(x)
        else:
            q = linear(cfg.q_lora_rank, ("embed", "latent"), "q_a_proj", cfg.attention_bias)(x)
            q = RMSNorm(LATENT_NORM_EPS, self.dtype, name="q_a_layernorm")(q)
            q = linear(heads * cfg.qk_head_dim, ("latent", "heads"), "q_b_proj")(q)
        q = q.reshape(batch, length, heads, cfg.qk_head_dim)
        compressed = linear(rank + rope_dim, ("embed", "latent"), "kv_a_proj_with_mqa", cfg.attention_bias)(x)
        latent = RMSNorm(LATENT_NORM_EPS, self.dtype, name="kv_a_layernorm")(compressed[..., :rank])
        expand = linear(heads * (nope + cfg.v_head_dim), ("latent", "heads"), "kv_b_proj")

        slots = next_positions(self, length)
        rope_positions = token_positions(slots, positions, batch)
        inv_freq, rope_scale = frequencies(cfg, slots)
        q_rot = rotate(q[..., nope:], inv_freq, rope_positions, rope_scale, cfg.rope_interleave)
        k_rot = rotate(compressed[..., None, rank:], inv_freq, rope_positions, rope_scale, cfg.rope_interleave)
        scale = softmax_scale(cfg)
        if decoding(self):
            out = self._attend_latent(
                q[..., :nope], q_rot, cached(self, "cached_latent", latent, slots),
                cached(self, "cached_rotary_key", k_rot[:, :, 0], slots), expand, scale, slots,
            )  # fmt: skip
        else:
            out = self._attend_expanded(q[..., :nope], q_rot, expand(latent), k_rot, scale, segment_ids)
        return linear(cfg.hidden_size, ("heads", "embed"), "o_proj", cfg.attention_bias)(
            out.reshape(batch, length, heads * cfg.v_head_dim)
        )

    def _attend_expanded(
        self, q_nope: Array, q_rot: Array, expanded: Array, k_rot: Array, scale: float, segment_ids: Array | None
    ) -> Array:
        """Training and scoring: per-head keys and values from the latent, any attention kernel."""
        cfg = self.config
        batch, length, heads, _ = q_nope.shape
        expanded = expanded.reshape(batch, length, heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, value = expanded[..., : cfg.qk_nope_head_dim], expanded[..., cfg.qk_nope_head_dim :]
        query = jnp.concatenate([q_nope, q_rot], axis=-1)
        key = jnp.concatenate([k_nope, jnp.broadcast_to(k_rot, (*k_nope.shape[:3], cfg.qk_rope_head_dim))], axis=-1)
        width = max(cfg.qk_head_dim, cfg.v_head_dim)
        out = attend(
            _widened(query, width),
            _widened(key, width),
            _widened(value, width),
            scale=scale,
            kernel=attention_kernel(cfg.attention, self.dtype, width),
            segment_ids=segment_ids,
        )
        return out[..., : cfg.v_head_dim]

    def _attend_latent(
        self, q_nope: Array, q_rot: Array, latent: Array, k_rot: Array, expand: nn.Dense, scale: float, slots: Array
    ) -> Array:
        """Decoding: the queries attend to the cached latents [B, S, rank] and rotary keys [B, S, rope] as one
        shared key/value head, ``kv_b_proj``'s key half absorbed into the queries, its value half applied after."""
        cfg = self.config
        heads, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        kernel: Array = expand.get_variable("params", "kernel")
        kernel = kernel.astype(self.dtype).reshape(rank, heads, nope + cfg.v_head_dim)
        key_up, value_up = kernel[..., :nope], kernel[..., nope:]
        query = jnp.concatenate([jnp.einsum("bthn,rhn->bthr", q_nope, key_up), q_rot], axis=-1)
        key = jnp.concatenate([latent, k_rot], axis=-1)[:, :, None]
        out = attend(
            query, key, _widened(latent[:, :, None], key.shape[-1]), scale=scale, kernel="xla", query_slots=slots
        )
        return jnp.einsum("bthr,rhv->bthv", out[..., :rank], value_up)
