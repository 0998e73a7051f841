"""Gemma 2 as a Flax module with the maths of HF's ``Gemma2ForCausalLM``.

What sets it apart from Llama: embeddings scaled by ``sqrt(hidden_size)``; RMSNorm computing
``norm(x) * (1 + weight)`` in float32 (the weight is stored zero-centred); a norm before *and* after both the
attention and the MLP; attention scaled by ``query_pre_attn_scalar ** -0.5`` with scores soft-capped by
``attn_logit_softcapping``; sliding-window and global layers alternating as ``layer_types`` says; a GeGLU
MLP (``hidden_activation``, Llama's MLP module); the LM head tied to the embedding, its logits soft-capped by
``final_logit_softcapping``. Parameter names mirror HF's.
"""

from functools import partial
from typing import Any, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.gemma2 import Gemma2Config
from functrain.models.head import tied_head
from functrain.models.hf_common import dense, embed, hf_config_dict, rms_normalized, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.llama import LlamaMLP
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import apply_rope, frequencies, hf_rope_parameters, parse_hf_rope
from functrain.models.scan import apply_layers
from functrain.parallel.sharding import constrain_batch

_Config = TypeVar("_Config", bound=Gemma2Config)


def config_from_hf(cls: type[_Config], hf: dict[str, Any]) -> _Config:
    """``cls`` (Gemma2Config or Gemma 3's) from an HF config.json dict; unimplemented settings are named."""
    name = cls.model_fields["name"].default
    if hf.get("use_bidirectional_attention"):
        raise ConfigError(f"config.json: use_bidirectional_attention is not supported for {name}; fix config.json")
    try:
        hf, scaling = parse_hf_rope(hf)
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for {name}; fix config.json") from None
    return cls.from_hf_dict(hf, **({"rope_scaling": scaling} if scaling else {}))


def config_to_hf(config: Gemma2Config, model_type: str, architecture: str) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) for ``config``'s family."""
    hf = hf_config_dict(config, exclude={"rope_theta", "rope_scaling"})
    hf.update(
        model_type=model_type,
        architectures=[architecture],
        rope_parameters=hf_rope_parameters(config),
        layer_types=[
            "sliding_attention" if config.attention_window(i) else "full_attention"
            for i in range(config.num_hidden_layers)
        ],
        attention_dropout=0.0,
    )
    return hf


def from_hf_config(hf: dict[str, Any]) -> Gemma2Config:
    """Gemma2Config from an HF config.json dict."""
    return config_from_hf(Gemma2Config, hf)


def to_hf_config(config: Gemma2Config) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as Gemma2ForCausalLM."""
    return config_to_hf(config, "gemma2", "Gemma2ForCausalLM")


class GemmaRMSNorm(nn.Module):
    """HF's Gemma2RMSNorm: ``norm(x) * (1 + weight)`` in float32, then cast (the weight starts at zero)."""

    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), (x.shape[-1],), jnp.float32
        )
        x32 = rms_normalized(x, self.epsilon)
        return (x32 * (1.0 + jnp.asarray(scale, jnp.float32))).astype(self.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)`` (identity when ``cap`` is None)."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class Gemma2Attention(nn.Module):
    """Grouped-query attention with RoPE, soft-capped scores and an optional sliding window."""

    config: Gemma2Config
    layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        batch, length, _ = x.shape
        std, bias = cfg.initializer_range, cfg.attention_bias

        def proj(features, axes, name):
            return dense(features, axes, use_bias=bias, dtype=self.dtype, init_std=std, name=name)

        q = proj(heads * head_dim, ("embed", "heads"), "q_proj")(x).reshape(batch, length, heads, head_dim)
        k = proj(kv_heads * head_dim, ("embed", "kv_heads"), "k_proj")(x).reshape(batch, length, kv_heads, head_dim)
        v = proj(kv_heads * head_dim, ("embed", "kv_heads"), "v_proj")(x).reshape(batch, length, kv_heads, head_dim)
        if cfg.qk_norm:
            q = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k)
        slots = next_positions(self, length)
        rope_positions = token_positions(slots, positions, batch)
        inv_freq, rope_scale = frequencies(cfg.rope_for(self.layer), slots)
        k, v = extend_cache(self, apply_rope(k, inv_freq, rope_positions, rope_scale), v, slots)
        out = attend(
            apply_rope(q, inv_freq, rope_positions, rope_scale),
            k,
            v,
            scale=cfg.query_pre_attn_scalar**-0.5,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
            window=cfg.attention_window(self.layer),
            softcap=cfg.attn_logit_softcapping,
        )
        return proj(cfg.hidden_size, ("heads", "embed"), "o_proj")(out.reshape(batch, length, heads * head_dim))


class Gemma2Block(nn.Module):
    """One decoder layer: norms before and after both the attention and the GeGLU MLP."""

    config: Gemma2Config
    layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config

        def norm(name):
            return GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name=name)

        attn = Gemma2Attention(cfg, self.layer, self.dtype, name="self_attn")(
            norm("input_layernorm")(x), segment_ids, positions
        )
        x = x + norm("post_attention_layernorm")(attn)
        h = LlamaMLP(cfg, self.dtype, name="mlp")(norm("pre_feedforward_layernorm")(x))  # GeGLU via hidden_act
        return x + norm("post_feedforward_layernorm")(h)


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 language model: ``apply({"params": p}, input_ids[B, T]) -> float32 logits [B, T, vocab]``."""

    config: Gemma2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None, logits_chunk=None):
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here).
        ``segment_ids`` / ``positions`` [B, T]: packed sequences, as for Llama; with ``logits_chunk`` the head
        unapplied (:mod:`functrain.models.head`)."""
        cfg = self.config
        tokens = embed(
            cfg.vocab_size,
            cfg.hidden_size,
            ("vocab", "embed"),
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="embed_tokens",
        )
        # HF multiplies by sqrt(hidden) rounded to the compute dtype.
        x = tokens(input_ids) * jnp.asarray(cfg.hidden_size**0.5, self.dtype)
        x = constrain_batch(x)
        block = remat_block(Gemma2Block, cfg.remat, prevent_cse=not cfg.scan_layers)
        # A layer's window decides its RoPE too (Gemma 3), so the windows give the period a scan repeats.
        x = apply_layers(
            x,
            kinds=cfg.layer_kinds(),
            make_block=lambda i, name: block(cfg, i, self.dtype, name=name),
            prefix="layers_",
            scan=cfg.scan_layers,
            args=(segment_ids, positions),
        )
        x = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        cap = cfg.final_logit_softcapping
        return tied_head(tokens, x, logits_chunk, None if cap is None else partial(soft_cap, cap=cap))


def build(config: Gemma2Config, dtype: Any = jnp.float32) -> Gemma2ForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.head_dim)
    check_remat(config.remat)
    return Gemma2ForCausalLM(config, dtype=dtype)
