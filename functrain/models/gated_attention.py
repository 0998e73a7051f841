"""The full-attention layers of Qwen3-Next and Qwen3.5 (transformers' ``Qwen3NextAttention``): grouped-query attention
whose ``q_proj`` also gives each head an output gate (``sigmoid``, applied before ``o_proj``), queries and keys
RMS-normalised per head around one (``q_norm``/``k_norm``, stored zero-centred), and RoPE on the leading
``partial_rotary_factor`` of each head's dimensions. Packed sequences and the KV cache as in
:mod:`functrain.models.llama`."""

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.qwen3_next import HybridConfig
from functrain.models.configs.rope import RopeScaling
from functrain.models.gemma2 import GemmaRMSNorm
from functrain.models.hf_common import dense, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.rope import apply_rope, frequencies

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Rotary:
    """What :func:`functrain.models.rope.frequencies` reads, for the rotated part of a head (``attn_head_dim``: its
    width)."""

    rope_theta: float
    attn_head_dim: int
    rope_scaling: RopeScaling | None
    max_position_embeddings: int

    @classmethod
    def of(cls, config: HybridConfig) -> "Rotary":
        """The rotated dimensions of ``config``'s heads."""
        return cls(config.rope_theta, config.rotary_dim, config.rope_scaling, config.max_position_embeddings)


def partial_rope(x: Array, rotated: int, inv_freq: Any, positions: Array, scale: float) -> Array:
    """RoPE on the first ``rotated`` dimensions of each head of ``x`` [B, T, H, D], the others passed through."""
    return jnp.concatenate([apply_rope(x[..., :rotated], inv_freq, positions, scale), x[..., rotated:]], axis=-1)


class GatedAttention(nn.Module):
    """``attention(x[B, T, hidden], segment_ids=None, positions=None) -> [B, T, hidden]`` (module docstring)."""

    config: HybridConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None = None, positions: Array | None = None) -> Array:
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.head_dim
        batch, length, _ = x.shape

        def project(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
            return dense(
                features, axes, use_bias=cfg.attention_bias, dtype=self.dtype, init_std=cfg.initializer_range, name=name
            )

        query_gate = project(heads * head_dim * 2, ("embed", "heads"), "q_proj")(x)
        q, gate = jnp.split(query_gate.reshape(batch, length, heads, 2 * head_dim), 2, axis=-1)
        k = project(kv_heads * head_dim, ("embed", "kv_heads"), "k_proj")(x).reshape(batch, length, kv_heads, head_dim)
        v = project(kv_heads * head_dim, ("embed", "kv_heads"), "v_proj")(x).reshape(batch, length, kv_heads, head_dim)
        q = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q)
        k = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k)
        slots = next_positions(self, length)
        rope_positions = token_positions(slots, positions, batch)
        inv_freq, rope_scale = frequencies(Rotary.of(cfg), slots)
        q, k = (partial_rope(part, cfg.rotary_dim, inv_freq, rope_positions, rope_scale) for part in (q, k))
        k, v = extend_cache(self, k, v, slots)
        out = attend(
            q,
            k,
            v,
            scale=head_dim**-0.5,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
        )
        out = out.reshape(batch, length, heads * head_dim) * jax.nn.sigmoid(gate.reshape(batch, length, -1))
        return project(cfg.hidden_size, ("heads", "embed"), "o_proj")(out)
