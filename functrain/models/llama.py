"""The Llama family as a Flax module with the maths of HF's ``LlamaForCausalLM``.

RMSNorm with ``rms_norm_eps``, rotary position embeddings with ``rope_theta`` (HF's rotate-half layout,
optional ``llama3`` frequency scaling), grouped-query attention (``num_key_value_heads``), a SwiGLU MLP,
optional attention/MLP biases, and a tied or separate LM head. Parameter names mirror HF's.

``LlamaForCausalLM(config)(input_ids[B, T], segment_ids=None, positions=None)``: for packed sequences,
``segment_ids`` [B, T] int32 keep attention within each document and ``positions`` [B, T] int32 (restarting
at 0 per document) drive RoPE. ``model.attention`` / ``model.remat`` / ``model.scan_layers``:
:mod:`functrain.models.options`.
"""

from collections.abc import Collection
from typing import Any, Protocol, TypeVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models.attention import attend, attention_kernel
from functrain.models.batch_invariant import traced_as_configured
from functrain.models.configs.llama import LlamaConfig
from functrain.models.hf_common import RMSNorm, activation, dense, embed, hf_config_dict, lm_head, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import apply_rope, frequencies, hf_rope_parameters, parse_hf_rope
from functrain.models.scan import apply_layers
from functrain.parallel.context import context_inputs, from_context_order
from functrain.parallel.sharding import constrain_batch

_Config = TypeVar("_Config", bound=LlamaConfig)


def config_from_hf(cls: type[_Config], hf: dict[str, Any], **overrides: Any) -> _Config:
    """``cls`` (LlamaConfig or a family's subclass) from an HF config.json dict, old (``rope_theta``/
    ``rope_scaling``) or v5 (``rope_parameters``) layout; a rope setting it does not implement is named."""
    try:
        hf, scaling = parse_hf_rope(hf)
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for {cls.model_fields['name'].default}; fix config.json") from None
    return cls.from_hf_dict(hf, **({"rope_scaling": scaling} if scaling else {}), **overrides)


def config_to_hf(
    config: LlamaConfig, model_type: str, architecture: str, exclude: Collection[str] = (), **extra: Any
) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) for ``config``'s family (``exclude``: fields HF lacks)."""
    hf = hf_config_dict(config, exclude={"rope_theta", "rope_scaling", *exclude})
    hf["num_key_value_heads"] = config.kv_heads
    hf["head_dim"] = config.attn_head_dim
    hf.update(
        model_type=model_type,
        architectures=[architecture],
        rope_parameters=hf_rope_parameters(config),
        attention_dropout=0.0,
        **extra,
    )
    return hf


def from_hf_config(hf: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig from an HF config.json dict."""
    return config_from_hf(LlamaConfig, hf)


def to_hf_config(config: LlamaConfig) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as LlamaForCausalLM."""
    return config_to_hf(config, "llama", "LlamaForCausalLM", pretraining_tp=1)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary position embeddings (and per-head sinks where the config has
    them)."""

    config: LlamaConfig
    dtype: Any
    layer: int = 0

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.kv_heads, cfg.attn_head_dim
        batch, length, _ = x.shape
        std, bias = cfg.initializer_range, cfg.qkv_bias

        def project(count: int, axes: tuple[str, str], name: str) -> jax.Array:
            return dense(count * head_dim, axes, use_bias=bias, dtype=self.dtype, init_std=std, name=name)(x)

        q = project(heads, ("embed", "heads"), "q_proj")
        k = project(kv_heads, ("embed", "kv_heads"), "k_proj")
        v = project(kv_heads, ("embed", "kv_heads"), "v_proj").reshape(batch, length, kv_heads, head_dim)
        if cfg.qk_norm and cfg.qk_norm_across_heads:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k)
        q, k = q.reshape(batch, length, heads, head_dim), k.reshape(batch, length, kv_heads, head_dim)
        if cfg.qk_norm and not cfg.qk_norm_across_heads:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, name="k_norm")(k)
        slots = next_positions(self, length)
        rope = cfg.rope_for(self.layer)
        if rope is not None:
            rope_positions = token_positions(slots, positions, batch)
            inv_freq, rope_scale = frequencies(rope, slots)
            q, k = (apply_rope(t, inv_freq, rope_positions, rope_scale) for t in (q, k))
        k, v = extend_cache(self, k, v, slots)
        sinks = None
        if cfg.attention_sinks:
            init = nn.with_logical_partitioning(nn.initializers.normal(std), ("heads",))
            sinks = nn.meta.unbox(self.param("sinks", init, (heads,), jnp.float32))
        out = attend(
            q,
            k,
            v,
            scale=head_dim**-0.5,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
            window=cfg.attention_window(self.layer),
            sinks=sinks,
        )
        return dense(
            cfg.hidden_size, ("heads", "embed"), use_bias=cfg.o_bias, dtype=self.dtype, init_std=std, name="o_proj"
        )(out.reshape(batch, length, heads * head_dim))


class LlamaMLPConfig(Protocol):
    """What :class:`LlamaMLP` reads from a config (Llama's family and Gemma's)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def initializer_range(self) -> float: ...


class LlamaMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)), ``width`` wide (None: the config's ``intermediate_size``)."""

    config: LlamaMLPConfig
    dtype: Any
    width: int | None = None

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        std, bias = cfg.initializer_range, cfg.mlp_bias
        width = cfg.intermediate_size if self.width is None else self.width
        gate = dense(width, ("embed", "mlp"), use_bias=bias, dtype=self.dtype, init_std=std, name="gate_proj")(x)
        up = dense(width, ("embed", "mlp"), use_bias=bias, dtype=self.dtype, init_std=std, name="up_proj")(x)
        return dense(
            cfg.hidden_size, ("mlp", "embed"), use_bias=bias, dtype=self.dtype, init_std=std, name="down_proj"
        )(activation(cfg.hidden_act)(gate) * up)


class LlamaBlock(nn.Module):
    """One decoder layer: RMSNorm before the attention and the MLP (after them with ``post_norms``)."""

    config: LlamaConfig
    dtype: Any
    layer: int = 0

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        eps = self.config.rms_norm_eps
        attention = LlamaAttention(self.config, self.dtype, self.layer, name="self_attn")
        mlp = LlamaMLP(self.config, self.dtype, name="mlp")
        if self.config.post_norms:  # OLMo 3: each sublayer's output normalised before the residual add
            x = x + RMSNorm(eps, self.dtype, name="post_attention_layernorm")(attention(x, segment_ids, positions))
            return x + RMSNorm(eps, self.dtype, name="post_feedforward_layernorm")(mlp(x))
        x = x + attention(RMSNorm(eps, self.dtype, name="input_layernorm")(x), segment_ids, positions)
        return x + mlp(RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x))


class LlamaForCausalLM(nn.Module):
    """Llama language model: ``apply({"params": p}, input_ids[B, T]) -> float32 logits [B, T, vocab]``."""

    config: LlamaConfig
    dtype: Any = jnp.float32

    @nn.compact
    @traced_as_configured
    def __call__(self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None, logits_chunk=None):
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here);
        ``segment_ids`` / ``positions``: see the module docstring; with ``logits_chunk`` the head unapplied
        (:mod:`functrain.models.head`)."""
        cfg = self.config
        # Under a context mesh axis the layers run on the sequence in load-balanced order (parallel/context.py).
        input_ids, segment_ids, positions, ways = context_inputs(input_ids, segment_ids, positions, decoding(self))
        tokens = embed(
            cfg.vocab_size,
            cfg.hidden_size,
            ("vocab", "embed"),
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="embed_tokens",
        )
        x = tokens(input_ids)
        x = constrain_batch(x)  # the batch axis stays put; FSDP weights are gathered (see sharding.py)
        block = remat_block(LlamaBlock, cfg.remat, prevent_cse=not cfg.scan_layers)
        x = apply_layers(
            x,
            kinds=cfg.layer_kinds(),
            make_block=lambda i, name: block(cfg, self.dtype, i, name=name),
            prefix="layers_",
            scan=cfg.scan_layers,
            args=(segment_ids, positions),
        )
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        x = from_context_order(x, ways)  # the logits in the batch's order, for the loss and every task
        return lm_head(self, tokens, x, cfg, cfg.initializer_range, logits_chunk)


def build(config: LlamaConfig, dtype: Any = jnp.float32) -> LlamaForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.attn_head_dim)
    check_remat(config.remat)
    return LlamaForCausalLM(config, dtype=dtype)
