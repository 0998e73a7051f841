"""GPT-2 as a Flax module with the maths of HF's ``GPT2LMHeadModel``.

Learned positions, pre-LayerNorm blocks with ``layer_norm_epsilon`` from config.json, the activation named by
``activation_function`` (``gelu_new`` is GPT-2's tanh approximation), and an LM head tied to the token
embedding. Parameter names mirror HF's so the conversion table in ``torch_bridge.hf.mappings`` reads
line by line; the fused ``c_attn`` is split into ``q``/``k``/``v`` here so each can be sharded by head.
"""

from typing import Any, Literal

import flax.linen as nn
import jax.numpy as jnp
import pydantic

from functrain.sharding import constrain_batch
from functrain.models.hf_common import (HFModelConfig, activation, causal_attention, check_activation, dense,
                                        embed, layer_norm)
from functrain.models.kv_cache import extend_cache, next_positions


class GPT2Config(HFModelConfig):
    """GPT-2 hyper-parameters, named as in HF's config.json."""

    name: Literal["gpt2"] = "gpt2"
    vocab_size: int = pydantic.Field(50257, gt=0)
    n_positions: int = pydantic.Field(1024, gt=0)
    n_embd: int = pydantic.Field(768, gt=0)
    n_layer: int = pydantic.Field(12, gt=0)
    n_head: int = pydantic.Field(12, gt=0)
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: Literal[True] = True

    @pydantic.model_validator(mode="after")
    def _heads_divide_width(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        check_activation(self.activation_function)
        return self

    @property
    def inner_size(self) -> int:
        """MLP width: ``n_inner`` or 4 × ``n_embd`` as in HF."""
        return self.n_inner or 4 * self.n_embd


def from_hf_config(hf: dict[str, Any]) -> GPT2Config:
    """GPT2Config from an HF config.json dict (unknown HF keys such as dropout rates are ignored)."""
    return GPT2Config.from_hf_dict(hf)


def to_hf_config(config: GPT2Config) -> dict[str, Any]:
    """An HF config.json dict that ``transformers.AutoModelForCausalLM`` loads as GPT2LMHeadModel."""
    hf = config.model_dump(exclude={"name", "lora"})
    hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"],
              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return hf


class GPT2Attention(nn.Module):
    """Causal self-attention; HF's fused ``c_attn`` is kept as separate q/k/v projections."""

    config: GPT2Config
    layer_idx: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        batch, length, _ = x.shape
        q, k, v = (dense(cfg.n_embd, ("embed", "heads"), use_bias=True, dtype=self.dtype,
                         init_std=cfg.initializer_range, name=n)(x).reshape(batch, length, heads, head_dim)
                   for n in ("q", "k", "v"))
        positions = next_positions(self, length)
        k, v = extend_cache(self, k, v, positions)
        scale = 1.0
        if cfg.scale_attn_weights:
            scale /= head_dim ** 0.5
        if cfg.scale_attn_by_inverse_layer_idx:
            scale /= float(self.layer_idx + 1)
        out = causal_attention(q, k, v, scale, positions).reshape(batch, length, cfg.n_embd)
        return dense(cfg.n_embd, ("heads", "embed"), use_bias=True, dtype=self.dtype,
                     init_std=cfg.initializer_range, name="c_proj")(out)


class GPT2MLP(nn.Module):
    """Two-layer MLP with the configured activation."""

    config: GPT2Config
    dtype: Any

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        h = dense(cfg.inner_size, ("embed", "mlp"), use_bias=True, dtype=self.dtype,
                  init_std=cfg.initializer_range, name="c_fc")(x)
        h = activation(cfg.activation_function)(h)
        return dense(cfg.n_embd, ("mlp", "embed"), use_bias=True, dtype=self.dtype,
                     init_std=cfg.initializer_range, name="c_proj")(h)


class GPT2Block(nn.Module):
    """One pre-LayerNorm transformer block."""

    config: GPT2Config
    layer_idx: int
    dtype: Any

    @nn.compact
    def __call__(self, x):
        eps = self.config.layer_norm_epsilon
        x = x + GPT2Attention(self.config, self.layer_idx, self.dtype, name="attn")(
            layer_norm(eps, dtype=self.dtype, name="ln_1")(x))
        return x + GPT2MLP(self.config, self.dtype, name="mlp")(layer_norm(eps, dtype=self.dtype, name="ln_2")(x))


class GPT2LMHead(nn.Module):
    """GPT-2 language model: ``apply({"params": p}, input_ids[B, T]) -> float32 logits [B, T, vocab]``."""

    config: GPT2Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True):
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here)."""
        cfg = self.config
        length = input_ids.shape[1]
        if length > cfg.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions {cfg.n_positions}")
        positions = next_positions(self, length)
        wte = embed(cfg.vocab_size, cfg.n_embd, ("vocab", "embed"), dtype=self.dtype,
                    init_std=cfg.initializer_range, name="wte")
        wpe = embed(cfg.n_positions, cfg.n_embd, (None, "embed"), dtype=self.dtype,
                    init_std=cfg.initializer_range, name="wpe")
        x = wte(input_ids) + wpe(positions)[None]
        x = constrain_batch(x)  # the batch axis stays put; FSDP weights are gathered (see sharding.py)
        for i in range(cfg.n_layer):
            x = constrain_batch(GPT2Block(cfg, i, self.dtype, name=f"h_{i}")(x))
        x = layer_norm(cfg.layer_norm_epsilon, dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x).astype(jnp.float32)  # tied LM head


def build(config: GPT2Config, dtype: Any = jnp.float32) -> GPT2LMHead:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32)."""
    return GPT2LMHead(config, dtype=dtype)


MODEL_SPEC = dict(config_cls=GPT2Config, build=build, kind="causal_lm")
