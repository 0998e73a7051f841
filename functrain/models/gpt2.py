"""GPT-2 as a Flax module with the maths of HF's ``GPT2LMHeadModel``.

Learned positions, pre-LayerNorm blocks with ``layer_norm_epsilon`` from config.json, the activation named by
``activation_function`` (``gelu_new`` is GPT-2's tanh approximation), and an LM head tied to the token
embedding. Parameter names mirror HF's so the conversion table in ``torch_bridge.hf.mappings`` reads
line by line; the fused ``c_attn`` is split into ``q``/``k``/``v`` here so each can be sharded by head.

``GPT2LMHead(config)(input_ids[B, T], segment_ids=None, positions=None)``: for packed sequences,
``segment_ids`` [B, T] int32 keep attention within each document and ``positions`` [B, T] int32 (restarting
at 0 per document) index ``wpe``. ``model.attention`` / ``model.remat``: :mod:`functrain.models.options`.
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.gpt2 import GPT2Config
from functrain.models.head import tied_head
from functrain.models.hf_common import activation, dense, embed, hf_config_dict, layer_norm, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.remat import check_remat, remat_block
from functrain.parallel.sharding import constrain_batch


def from_hf_config(hf: dict[str, Any]) -> GPT2Config:
    """GPT2Config from an HF config.json dict (unknown HF keys such as dropout rates are ignored)."""
    return GPT2Config.from_hf_dict(hf)


def to_hf_config(config: GPT2Config) -> dict[str, Any]:
    """An HF config.json dict that ``transformers.AutoModelForCausalLM`` loads as GPT2LMHeadModel."""
    hf = hf_config_dict(config)
    hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf


class GPT2Attention(nn.Module):
    """Causal self-attention; HF's fused ``c_attn`` is kept as separate q/k/v projections."""

    config: GPT2Config
    layer_idx: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None):
        cfg = self.config
        heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        batch, length, _ = x.shape
        q, k, v = (
            dense(
                cfg.n_embd, ("embed", "heads"), use_bias=True, dtype=self.dtype, init_std=cfg.initializer_range, name=n
            )(x).reshape(batch, length, heads, head_dim)
            for n in ("q", "k", "v")
        )
        slots = next_positions(self, length)
        k, v = extend_cache(self, k, v, slots)
        scale = 1.0
        if cfg.scale_attn_weights:
            scale /= head_dim**0.5
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(self.layer_idx + 1)
        out = attend(
            q,
            k,
            v,
            scale=scale,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
        )
        out = out.reshape(batch, length, cfg.n_embd)
        return dense(
            cfg.n_embd,
            ("heads", "embed"),
            use_bias=True,
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="c_proj",
        )(out)


class GPT2MLP(nn.Module):
    """Two-layer MLP with the configured activation."""

    config: GPT2Config
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        h = dense(
            cfg.inner_size,
            ("embed", "mlp"),
            use_bias=True,
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="c_fc",
        )(x)
        h = activation(cfg.activation_function)(h)
        return dense(
            cfg.n_embd, ("mlp", "embed"), use_bias=True, dtype=self.dtype, init_std=cfg.initializer_range, name="c_proj"
        )(h)


class GPT2Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    config: GPT2Config
    layer_idx: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None):
        eps = self.config.layer_norm_epsilon
        x = x + GPT2Attention(self.config, self.layer_idx, self.dtype, name="attn")(
            layer_norm(eps, dtype=self.dtype, name="ln_1")(x), segment_ids
        )
        return x + GPT2MLP(self.config, self.dtype, name="mlp")(layer_norm(eps, dtype=self.dtype, name="ln_2")(x))


class GPT2LMHead(nn.Module):
    """GPT-2 language model: ``apply({"params": p}, input_ids[B, T]) -> float32 logits [B, T, vocab]``."""

    config: GPT2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None, logits_chunk=None):
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here);
        ``segment_ids`` / ``positions``: see the module docstring; with ``logits_chunk`` the head unapplied
        (:mod:`functrain.models.head`)."""
        cfg = self.config
        length = input_ids.shape[1]
        if length > cfg.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {cfg.n_positions}")
        slots = next_positions(self, length)
        wte = embed(
            cfg.vocab_size, cfg.n_embd, ("vocab", "embed"), dtype=self.dtype, init_std=cfg.initializer_range, name="wte"
        )
        wpe = embed(
            cfg.n_positions, cfg.n_embd, (None, "embed"), dtype=self.dtype, init_std=cfg.initializer_range, name="wpe"
        )
        x = wte(input_ids) + wpe(token_positions(slots, positions, input_ids.shape[0]))
        x = constrain_batch(x)  # the batch axis stays put; FSDP weights are gathered (see sharding.py)
        block = remat_block(GPT2Block, cfg.remat)
        for i in range(cfg.n_layer):
            x = constrain_batch(block(cfg, i, self.dtype, name=f"h_{i}")(x, segment_ids))
        x = layer_norm(cfg.layer_norm_epsilon, dtype=self.dtype, name="ln_f")(x)
        return tied_head(wte, x, logits_chunk)


def build(config: GPT2Config, dtype: Any = jnp.float32) -> GPT2LMHead:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.n_embd // config.n_head)
    check_remat(config.remat)
    return GPT2LMHead(config, dtype=dtype)
