"""Gemma 4's language model as a Flax module with the maths of transformers' ``Gemma4ForCausalLM``
(``gemma4_text``).

What sets it apart from Gemma 3: RMS norms multiply by their weight (not ``1 + weight``); queries and keys are
RMS-normalised per head with weights, values without, and attention is unscaled (scale 1, no soft-cap); sliding
and global layers (the last always global) have their own head width and key/value heads, and their own rope (the
global one by default transformers' *proportional* rope, a quarter of each head's frequencies turning); on global
layers with ``attention_k_eq_v`` the key projection is the values too (before the key norm and rope). Each layer
ends scaled by its ``layer_scalar``. With ``hidden_size_per_layer_input`` every layer adds its own input: a
per-layer token embedding (``embed_tokens_per_layer``) mixed with a projection of the input embeddings, gated by
the hidden state. With ``enable_moe_block`` experts run beside every MLP on the layer's residual, routed by a
normalised, scaled router whose chosen weights are renormalised and scaled per expert. The head may be tied, its
logits soft-capped (``final_logit_softcapping``).

The last ``num_kv_shared_layers`` layers (Gemma 4 E2B/E4B) have no key/value projections: each attends with its own
queries to the keys and values (normalised, rotated and, when decoding, the whole cache) of the last earlier layer
of its type, and keeps no cache of its own; with ``use_double_wide_mlp`` their MLPs are twice as wide. They form a
run of layers of their own (``kv_shared_layers_{j}``, scanned apart from the others), the keys and values passed to
it by layer type.
"""

from functools import partial
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.core.model_output import ModelOutput
from functrain.models.attention import attend, attention_kernel
from functrain.models.configs.gemma4 import KV_SHARED_PREFIX, LAYER_PREFIX, Gemma4TextConfig
from functrain.models.gemma2 import soft_cap
from functrain.models.gemma4_config import from_hf_config, to_hf_config
from functrain.models.gemma4_experts import experts_beside_mlp
from functrain.models.head import tied_head, untied_head
from functrain.models.hf_common import activation, dense, embed, rms_normalized, token_positions
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.llama import LlamaMLP
from functrain.models.moe.balance import moe_output
from functrain.models.moe.decoder import balancing
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import apply_rope, frequencies
from functrain.models.scan import apply_layers, layer_period
from functrain.parallel.sharding import constrain_batch

Array = jax.Array
__all__ = ["Gemma4ForCausalLM", "build", "from_hf_config", "to_hf_config"]


class Gemma4Norm(nn.Module):
    """transformers' Gemma4RMSNorm: normalised in float32, times the float32 weight (initially one) unless
    ``with_scale`` is False, then cast."""

    epsilon: float
    dtype: Any = jnp.float32
    with_scale: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        normed = rms_normalized(x, self.epsilon)
        if self.with_scale:
            ones = nn.with_logical_partitioning(nn.initializers.ones, ("norm",))
            normed = normed * jnp.asarray(self.param("scale", ones, (x.shape[-1],), jnp.float32), jnp.float32)
        return normed.astype(self.dtype)


def rope_frequencies(cfg: Gemma4TextConfig, layer: int, slots: Array) -> tuple[Any, float]:
    """``(inverse frequencies [head_dim / 2], cos/sin scale)`` of ``layer``'s type: proportional rope turns the first
    ``partial_rotary_factor`` of them (transformers' exponents over the whole head) and zeroes the others."""
    rope, settings = cfg.rope_of(layer)
    inv_freq, scale = frequencies(settings, slots)  # a proportional rope has no other scaling
    if not rope.proportional:
        return inv_freq, scale
    turning = int(rope.partial_rotary_factor * settings.attn_head_dim // 2)
    return jnp.where(jnp.arange(inv_freq.shape[0]) < turning, inv_freq, 0.0) / rope.factor, 1.0


class Gemma4Attention(nn.Module):
    """Grouped-query attention with per-head q/k/v norms and this layer's head width, rope and window."""

    config: Gemma4TextConfig
    layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, shared_kv=None):
        """The attention's output, and with it ``(keys, values)`` on a layer whose keys and values later layers
        reuse; a layer reusing them attends to ``shared_kv``."""
        cfg, layer = self.config, self.layer
        heads, kv_heads, head_dim = cfg.num_attention_heads, cfg.kv_heads_of(layer), cfg.head_dim_of(layer)
        batch, length, _ = x.shape
        std, bias = cfg.initializer_range, cfg.attention_bias

        def project(count: int, axes: tuple[str, str], name: str) -> Array:
            out = dense(count * head_dim, axes, use_bias=bias, dtype=self.dtype, init_std=std, name=name)(x)
            return out.reshape(batch, length, count, head_dim)

        def norm(name: str, with_scale: bool = True) -> Gemma4Norm:
            return Gemma4Norm(cfg.rms_norm_eps, self.dtype, with_scale, name=name)

        q = norm("q_norm")(project(heads, ("embed", "heads"), "q_proj"))
        shared = cfg.kv_shared(layer)
        if not shared:
            k = project(kv_heads, ("embed", "kv_heads"), "k_proj")
            v = k if cfg.values_are_keys(layer) else project(kv_heads, ("embed", "kv_heads"), "v_proj")
        slots = next_positions(self, length)
        rope_positions = token_positions(slots, positions, batch)
        inv_freq, rope_scale = rope_frequencies(cfg, layer, slots)
        if shared:
            q, (k, v) = apply_rope(q, inv_freq, rope_positions, rope_scale), shared_kv
        else:
            q, k = (apply_rope(t, inv_freq, rope_positions, rope_scale) for t in (q, norm("k_norm")(k)))
            k, v = extend_cache(self, k, norm("v_norm", with_scale=False)(v), slots)
        out = attend(
            q,
            k,
            v,
            scale=1.0,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            segment_ids=segment_ids,
            query_slots=slots if decoding(self) else None,
            window=cfg.attention_window(layer),
        )
        out = dense(cfg.hidden_size, ("heads", "embed"), use_bias=bias, dtype=self.dtype, init_std=std, name="o_proj")(
            out.reshape(batch, length, heads * head_dim)
        )
        return (out, (k, v)) if cfg.kv_stored(layer) else out


class Gemma4Block(nn.Module):
    """One decoder layer: Gemma's norms around the attention and the feed-forward (the MLP, plus the experts on the
    residual with ``enable_moe_block``), then the per-layer input, then ``layer_scalar``. Returns the hidden states
    (with the experts' statistics: ``(x, stats)``), and after them its ``(keys, values)`` where later layers reuse
    them; ``shared_kv`` maps a layer type to the keys and values a layer of that type reuses."""

    config: Gemma4TextConfig
    layer: int
    dtype: Any

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, token_mask=None, shared_kv=None, layer_input=None):
        cfg, layer = self.config, self.layer

        def norm(name: str) -> Gemma4Norm:
            return Gemma4Norm(cfg.rms_norm_eps, self.dtype, name=name)

        reused = shared_kv[cfg.resolved_layer_types()[layer]] if cfg.kv_shared(layer) else None
        attn = Gemma4Attention(cfg, layer, self.dtype, name="self_attn")(
            norm("input_layernorm")(x), segment_ids, positions, reused
        )
        attn, stored = attn if cfg.kv_stored(layer) else (attn, None)
        residual = x + norm("post_attention_layernorm")(attn)
        h = LlamaMLP(cfg, self.dtype, cfg.mlp_width_of(layer), name="mlp")(norm("pre_feedforward_layernorm")(residual))
        stats = None
        if cfg.enable_moe_block:
            experts, stats = experts_beside_mlp(
                cfg, self.dtype, residual, norm("pre_feedforward_layernorm_2")(residual), token_mask
            )
            h = norm("post_feedforward_layernorm_1")(h) + norm("post_feedforward_layernorm_2")(experts)
        x = residual + norm("post_feedforward_layernorm")(h)
        if cfg.per_layer_inputs:
            width, std = cfg.hidden_size_per_layer_input, cfg.initializer_range
            gate = dense(width, ("embed", "mlp"), use_bias=False, dtype=self.dtype, init_std=std,
                         name="per_layer_input_gate")(x)  # fmt: skip
            mixed = activation(cfg.hidden_activation)(gate) * layer_input.astype(gate.dtype)
            projected = dense(cfg.hidden_size, ("mlp", "embed"), use_bias=False, dtype=self.dtype, init_std=std,
                              name="per_layer_projection")(mixed)  # fmt: skip
            x = x + norm("post_per_layer_input_norm")(projected)
        scalar = self.param("layer_scalar", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (1,))
        x = x * jnp.asarray(scalar, x.dtype)
        out = x if stats is None else (x, stats)
        return out if stored is None else (out, stored)


class Gemma4ForCausalLM(nn.Module):
    """``apply({"params": p}, input_ids[B, T]) -> ModelOutput`` (float32 ``.logits`` [B, T, vocab]; with the MoE
    block also the experts' statistics)."""

    config: Gemma4TextConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None, token_mask=None,
        logits_chunk=None,
    ) -> ModelOutput:  # fmt: skip
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here);
        ``segment_ids`` / ``positions`` [B, T]: packed sequences, as for Llama; ``token_mask`` [B, T]: the tokens
        the experts' statistics count; with ``logits_chunk`` the head unapplied (:mod:`functrain.models.head`)."""
        cfg = self.config
        tokens = embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"), dtype=self.dtype,
                       init_std=cfg.initializer_range, name="embed_tokens")  # fmt: skip
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype.
        x = constrain_batch(tokens(input_ids) * jnp.asarray(cfg.hidden_size**0.5, self.dtype))
        layer_inputs = self.per_layer_inputs(input_ids, x) if cfg.per_layer_inputs else None
        x, stats = self.layers(x, (segment_ids, positions, token_mask), layer_inputs)
        x = Gemma4Norm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        cap = cfg.final_logit_softcapping
        finish = None if cap is None else partial(soft_cap, cap=cap)
        if cfg.tie_word_embeddings:
            logits = tied_head(tokens, x, logits_chunk, finish)
        else:
            head = dense(cfg.vocab_size, ("embed", "vocab"), use_bias=False, dtype=self.dtype,
                         init_std=cfg.initializer_range, name="lm_head", fp8=False)  # fmt: skip
            logits = untied_head(self, x, head, logits_chunk, finish)
        return ModelOutput(logits) if stats is None else moe_output(logits, stats, balancing(cfg))

    def layers(self, x: Array, args: tuple, layer_inputs: Array | None) -> tuple[Array, Any]:
        """``(hidden states, the experts' statistics [L, ...] or None)`` after every layer: those computing their
        own keys and values (scanned, but for the group of the last ones whose keys and values later layers reuse,
        run one by one to hand them on), then those reusing them (scanned as a run of their own)."""
        cfg = self.config
        block = remat_block(Gemma4Block, cfg.remat, prevent_cse=not cfg.scan_layers)
        kinds, first_shared, layers = cfg.layer_kinds(), cfg.first_kv_shared_layer, cfg.num_hidden_layers
        sources = [i for i in range(first_shared) if cfg.kv_stored(i)]
        period = layer_period(kinds[:first_shared])
        handing_on = sources[0] // period * period if sources else first_shared  # the first layer run alone
        stats: list[Any] = []

        def run(x: Array, start: int, stop: int, prefix: str, shared_kv: Any = None) -> Array:
            out = apply_layers(
                x,
                kinds=kinds[start:stop],
                make_block=lambda j, name: block(cfg, start + j, self.dtype, name=name),
                prefix=prefix,
                scan=cfg.scan_layers,
                args=(*args, shared_kv),
                layer_inputs=None if layer_inputs is None else layer_inputs[start:stop],
                collect=cfg.enable_moe_block,
                pipelined=False,
            )
            out, run_stats = out if cfg.enable_moe_block else (out, None)
            stats.append(run_stats)
            return out

        if handing_on:
            x = run(x, 0, handing_on, LAYER_PREFIX)
        shared_kv = {}
        for i in range(handing_on, first_shared):
            own = () if layer_inputs is None else (layer_inputs[i],)
            out = block(cfg, i, self.dtype, name=cfg.layer_name(i))(x, *args, None, *own)
            if cfg.kv_stored(i):
                out, shared_kv[cfg.resolved_layer_types()[i]] = out
            x, layer_stats = out if cfg.enable_moe_block else (out, None)
            stats.append(jax.tree.map(lambda leaf: leaf[None], layer_stats))
        if first_shared < layers:
            x = run(x, first_shared, layers, KV_SHARED_PREFIX, shared_kv)
        if not cfg.enable_moe_block:
            return x, None
        return x, jax.tree.map(lambda *runs: jnp.concatenate(runs), *stats)

    @nn.nowrap
    def trainable_mask(self, params: Any) -> Any:
        """False at the layers' ``layer_scalar`` (a buffer transformers never trains), True elsewhere."""
        return unflatten_dict({path: path[-1] != "layer_scalar" for path in flatten_dict(params)})

    def per_layer_inputs(self, input_ids: Array, x: Array) -> Array:
        """``[L, B, T, hidden_size_per_layer_input]``: each layer's token embedding (``embed_tokens_per_layer``,
        scaled by ``sqrt(width)``) and its slice of the normalised projection of the input embeddings ``x``, summed
        and scaled by ``1 / sqrt(2)``."""
        cfg = self.config
        layers, width, std = cfg.num_hidden_layers, cfg.hidden_size_per_layer_input, cfg.initializer_range
        table = embed(cfg.vocab_size_per_layer_input, layers * width, ("vocab", "embed"), dtype=self.dtype,
                      init_std=std, name="embed_tokens_per_layer")  # fmt: skip
        by_token = table(input_ids) * jnp.asarray(width**0.5, self.dtype)
        projection = dense(layers * width, ("embed", "mlp"), use_bias=False, dtype=self.dtype, init_std=std,
                           name="per_layer_model_projection")(x)  # fmt: skip
        projection = projection * jnp.asarray(cfg.hidden_size**-0.5, self.dtype)
        shape = (*input_ids.shape, layers, width)
        normed = Gemma4Norm(cfg.rms_norm_eps, self.dtype, name="per_layer_projection_norm")(projection.reshape(shape))
        mixed = (normed + by_token.reshape(shape)) * jnp.asarray(2.0**-0.5, self.dtype)
        return jnp.moveaxis(mixed, 2, 0)


def build(config: Gemma4TextConfig, dtype: Any = jnp.float32) -> Gemma4ForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its attention
    kernel or remat policy cannot run here."""
    for head_dim in {config.head_dim_of(i) for i in range(config.num_hidden_layers)}:
        attention_kernel(config.attention, dtype, head_dim)
    check_remat(config.remat)
    return Gemma4ForCausalLM(config, dtype=dtype)
