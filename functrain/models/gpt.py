"""A small GPT (decoder-only causal language model) with logical axis names for sharding."""

from typing import Any, Literal

import flax.linen as nn
import jax.numpy as jnp
from pydantic import BaseModel, ConfigDict, Field, model_validator

from functrain.models.kv_cache import causal_mask, extend_cache, next_positions
from functrain.sharding import constrain_batch


class GPTConfig(BaseModel):
    """``model.*`` keys of the GPT."""
    model_config = ConfigDict(extra="forbid")
    name: Literal["gpt"] = "gpt"
    vocab_size: int = Field(256, ge=2)  # byte-level text
    max_len: int = Field(256, ge=1)
    d_model: int = Field(128, ge=1)
    n_layers: int = Field(2, ge=1)
    n_heads: int = Field(4, ge=1)
    d_ff: int = Field(512, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> "GPTConfig":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                             f"choose n_heads so that d_model / n_heads is a whole head width")
        return self


def _param(init: Any, names: tuple[str, ...]) -> Any:
    return nn.with_logical_partitioning(init, names)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual."""
    config: GPTConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool) -> jnp.ndarray:
        cfg = self.config
        head_dim = cfg.d_model // cfg.n_heads
        init = nn.initializers.normal(0.02)
        # Residual projections are scaled down with depth (GPT-2) so the residual stream stays O(1).
        out_init = nn.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)
        norm = lambda name: nn.LayerNorm(dtype=self.dtype, name=name,  # noqa: E731
                                         scale_init=_param(nn.initializers.ones, ("norm",)),
                                         bias_init=_param(nn.initializers.zeros, ("norm",)))
        h = norm("ln_attn")(x)
        qkv = [nn.DenseGeneral((cfg.n_heads, head_dim), dtype=self.dtype, name=name,
                               kernel_init=_param(init, ("embed", "heads", "head_dim")),
                               bias_init=_param(nn.initializers.zeros, ("heads", "head_dim")))(h)
               for name in ("query", "key", "value")]
        query, key, value = qkv
        positions = next_positions(self, x.shape[1])
        key, value = extend_cache(self, key, value, positions)
        causal = causal_mask(positions, key.shape[1])[None, None]
        attended = nn.dot_product_attention(query, key, value, mask=causal, dtype=self.dtype)
        attended = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=self.dtype, name="attn_out",
                                   kernel_init=_param(out_init, ("heads", "head_dim", "embed")),
                                   bias_init=_param(nn.initializers.zeros, ("embed",)))(attended)
        x = x + nn.Dropout(cfg.dropout)(attended, deterministic=deterministic)
        h = norm("ln_mlp")(x)
        h = nn.Dense(cfg.d_ff, dtype=self.dtype, name="mlp_in", kernel_init=_param(init, ("embed", "mlp")),
                     bias_init=_param(nn.initializers.zeros, ("mlp",)))(h)
        h = nn.gelu(h)
        h = nn.Dense(cfg.d_model, dtype=self.dtype, name="mlp_out", kernel_init=_param(out_init, ("mlp", "embed")),
                     bias_init=_param(nn.initializers.zeros, ("embed",)))(h)
        return x + nn.Dropout(cfg.dropout)(h, deterministic=deterministic)


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, a final norm and an untied head."""
    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        cfg = self.config
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=self.dtype, name="token_embed",
                         embedding_init=_param(init, ("vocab", "embed")))
        positions = self.param("position_embed", _param(init, ("max_len", "embed")), (cfg.max_len, cfg.d_model))
        x = embed(tokens) + positions[next_positions(self, tokens.shape[1])].astype(self.dtype)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        # Pinning the residual stream's batch axis makes XLA gather FSDP-sharded weights (ZeRO-3)
        # instead of resharding activations.
        x = constrain_batch(x)
        for i in range(cfg.n_layers):
            x = constrain_batch(Block(cfg, self.dtype, name=f"block_{i}")(x, deterministic))
        x = nn.LayerNorm(dtype=self.dtype, name="ln_final", scale_init=_param(nn.initializers.ones, ("norm",)),
                         bias_init=_param(nn.initializers.zeros, ("norm",)))(x)
        logits = nn.Dense(cfg.vocab_size, dtype=self.dtype, name="head", kernel_init=_param(init, ("embed", "vocab")),
                          use_bias=False)(x)
        return logits.astype(jnp.float32)


def build(config: GPTConfig, dtype: Any = jnp.float32) -> GPT:
    """The GPT module for ``config``, computing in ``dtype``."""
    return GPT(config, dtype=dtype)


MODEL_SPEC = dict(config_cls=GPTConfig, build=build, kind="causal_lm")
