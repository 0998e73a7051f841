"""A small GPT (decoder-only causal language model) with logical axis names for sharding.

``GPT(config)(tokens[B, T], deterministic, segment_ids=None, positions=None) -> float32 logits [B, T, vocab]``.
For packed sequences, ``segment_ids`` [B, T] int32 keep attention within each document and ``positions``
[B, T] int32 (restarting at 0 per document) index the position embeddings; without them the sequence is one
document at positions ``0..T-1``. ``model.attention``, ``model.remat`` and ``model.scan_layers`` choose the
attention kernel, what the backward pass recomputes and whether the blocks are one scan
(:mod:`functrain.models.options`).
"""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.core.unembedding import LogitsChunk
from functrain.models.attention import attend, attention_kernel
from functrain.models.batch_invariant import traced_as_configured
from functrain.models.configs.gpt import GPTConfig
from functrain.models.head import untied_head
from functrain.models.kv_cache import decoding, extend_cache, next_positions
from functrain.models.matmul import dense_dot_general, unquantized_dot_general
from functrain.models.remat import check_remat, remat_block
from functrain.models.scan import apply_layers
from functrain.parallel.context import context_inputs, from_context_order
from functrain.parallel.sharding import constrain_batch


def _param(init: Any, names: tuple[str, ...]) -> Any:
    return nn.with_logical_partitioning(init, names)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention then an MLP, each with a residual."""

    config: GPTConfig
    dtype: Any

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool, segment_ids: jnp.ndarray | None = None) -> jnp.ndarray:
        cfg = self.config
        head_dim = cfg.d_model // cfg.n_heads
        init = nn.initializers.normal(0.02)
        # Residual projections are scaled down with depth (GPT-2) so the residual stream stays O(1).
        out_init = nn.initializers.normal(0.02 / (2 * cfg.n_layers) ** 0.5)

        def norm(name: str) -> nn.LayerNorm:
            return nn.LayerNorm(
                dtype=self.dtype,
                name=name,
                scale_init=_param(nn.initializers.ones, ("norm",)),
                bias_init=_param(nn.initializers.zeros, ("norm",)),
            )

        h = norm("ln_attn")(x)
        product = dense_dot_general  # see functrain.models.matmul
        qkv = [
            nn.DenseGeneral(
                (cfg.n_heads, head_dim),
                dtype=self.dtype,
                dot_general=product,
                name=name,
                kernel_init=_param(init, ("embed", "heads", "head_dim")),
                bias_init=_param(nn.initializers.zeros, ("heads", "head_dim")),
            )(h)
            for name in ("query", "key", "value")
        ]
        query, key, value = qkv
        slots = next_positions(self, x.shape[1])
        key, value = extend_cache(self, key, value, slots)
        attended = attend(
            query,
            key,
            value,
            scale=head_dim**-0.5,
            segment_ids=segment_ids,
            kernel=attention_kernel(cfg.attention, self.dtype, head_dim),
            query_slots=slots if decoding(self) else None,
        )
        attended = nn.DenseGeneral(
            cfg.d_model,
            axis=(-2, -1),
            dtype=self.dtype,
            dot_general=product,
            name="attn_out",
            kernel_init=_param(out_init, ("heads", "head_dim", "embed")),
            bias_init=_param(nn.initializers.zeros, ("embed",)),
        )(attended)
        x = x + nn.Dropout(cfg.dropout)(attended, deterministic=deterministic)
        h = norm("ln_mlp")(x)
        h = nn.Dense(
            cfg.d_ff,
            dtype=self.dtype,
            dot_general=product,
            name="mlp_in",
            kernel_init=_param(init, ("embed", "mlp")),
            bias_init=_param(nn.initializers.zeros, ("mlp",)),
        )(h)
        h = nn.gelu(h)
        h = nn.Dense(
            cfg.d_model,
            dtype=self.dtype,
            dot_general=product,
            name="mlp_out",
            kernel_init=_param(out_init, ("mlp", "embed")),
            bias_init=_param(nn.initializers.zeros, ("embed",)),
        )(h)
        return x + nn.Dropout(cfg.dropout)(h, deterministic=deterministic)


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, a final norm and an untied head."""

    config: GPTConfig
    dtype: Any = jnp.float32

    @nn.compact
    @traced_as_configured
    def __call__(
        self,
        tokens: jnp.ndarray,
        deterministic: bool = True,
        *,
        segment_ids: jnp.ndarray | None = None,
        positions: jnp.ndarray | None = None,
        logits_chunk: LogitsChunk | None = None,
    ) -> Any:
        """Logits for ``tokens``; see the module docstring for ``segment_ids`` and ``positions``; with
        ``logits_chunk`` the head unapplied (:mod:`functrain.models.head`)."""
        cfg = self.config
        init = nn.initializers.normal(0.02)
        embed = nn.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=self.dtype,
            name="token_embed",
            embedding_init=_param(init, ("vocab", "embed")),
        )
        position_table = self.param("position_embed", _param(init, ("max_len", "embed")), (cfg.max_len, cfg.d_model))
        # Under a context mesh axis the blocks run on the sequence in load-balanced order (parallel/context.py).
        tokens, segment_ids, positions, ways = context_inputs(tokens, segment_ids, positions, decoding(self))
        slots = next_positions(self, tokens.shape[1])
        x = embed(tokens) + position_table[slots if positions is None else positions].astype(self.dtype)
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        # Pinning the residual stream's batch axis makes XLA gather FSDP-sharded weights (ZeRO-3)
        # instead of resharding activations.
        x = constrain_batch(x)
        # deterministic is a Python bool
        block = remat_block(Block, cfg.remat, static_argnums=(2,), prevent_cse=not cfg.scan_layers)
        x = apply_layers(
            x,
            kinds=cfg.layer_kinds(),
            make_block=lambda i, name: block(cfg, self.dtype, name=name),
            prefix="block_",
            scan=cfg.scan_layers,
            leading_args=(deterministic,),
            args=(segment_ids,),
        )
        x = nn.LayerNorm(
            dtype=self.dtype,
            name="ln_final",
            scale_init=_param(nn.initializers.ones, ("norm",)),
            bias_init=_param(nn.initializers.zeros, ("norm",)),
        )(x)
        x = from_context_order(x, ways)  # the logits in the batch's order, for the loss and every task
        head = nn.Dense(
            cfg.vocab_size,
            dtype=self.dtype,
            dot_general=unquantized_dot_general,  # never FP8 (functrain.models.matmul)
            name="head",
            kernel_init=_param(init, ("embed", "vocab")),
            use_bias=False,
        )
        return untied_head(self, x, head, logits_chunk)


def build(config: GPTConfig, dtype: Any = jnp.float32) -> GPT:
    """The GPT module for ``config``, computing in ``dtype``; a ConfigError if its attention kernel or remat
    policy cannot run here."""
    attention_kernel(config.attention, dtype, config.d_model // config.n_heads)
    check_remat(config.remat)
    return GPT(config, dtype=dtype)
