"""Pieces shared by the HF-compatible models (GPT-2, Llama): layers, position handling, the config as HF keys.

The maths follows the PyTorch reference implementations in `transformers` so that a converted checkpoint
gives the same logits to float32 precision; see `torch_bridge.hf` for the weight conversion. Attention is
:func:`functrain.models.attention.attend`; both models take optional ``segment_ids`` and ``positions``
[B, T] int32 for packed sequences (see :func:`token_positions`).
"""

from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.configs.hf import ACTIVATIONS, HFModelConfig, check_activation
from functrain.models.head import tied_head, untied_head
from functrain.models.matmul import dense_dot_general, unquantized_dot_general
from functrain.models.options import RUNTIME_KEYS

Array = jax.Array


# What each supported HF activation name (configs.hf.ACTIVATIONS) computes.
FUNCTIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
}


def activation(name: str) -> Callable[[Array], Array]:
    """The activation function HF calls ``name``."""
    return FUNCTIONS[ACTIVATIONS[check_activation(name)]]


def dense(
    features: int,
    axes: tuple[str | None, str | None],
    *,
    use_bias: bool,
    dtype: Any,
    init_std: float,
    name: str,
    fp8: bool = True,
) -> nn.Dense:
    """A float32 Dense layer whose kernel (and bias) carry logical axis names for sharding (its product:
    :mod:`functrain.models.matmul`; ``fp8=False``: never an FP8 product, for the LM head and the MoE router)."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        dot_general=dense_dot_general if fp8 else unquantized_dot_general,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(init_std), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)),
        name=name,
    )


def lm_head(parent: nn.Module, embedding: nn.Embed, x: Any, cfg: Any, init_std: float, logits_chunk: Any) -> Any:
    """An HF-style causal LM's head on its final hidden states ``x``, declared in the compact module ``parent``: the
    input ``embedding`` transposed when ``cfg.tie_word_embeddings``, else a Dense named ``lm_head`` (the logits, or
    an :class:`~functrain.core.unembedding.Unembedding` with ``logits_chunk``; see :mod:`functrain.models.head`)."""
    return lm_head_of(parent, embedding, cfg, init_std)(x, logits_chunk)


def lm_head_of(parent: nn.Module, embedding: nn.Embed, cfg: Any, init_std: float) -> Callable[..., Any]:
    """:func:`lm_head` declared once, as a function ``head(x, logits_chunk=None)`` that may be called on several
    hidden states with the same weights (multi-token prediction's shared head)."""
    if cfg.tie_word_embeddings:
        return lambda x, logits_chunk=None: tied_head(embedding, x, logits_chunk)
    head = dense(cfg.vocab_size, ("embed", "vocab"), use_bias=False, dtype=parent.dtype, init_std=init_std,
                 name="lm_head", fp8=False)  # fmt: skip
    return lambda x, logits_chunk=None: untied_head(parent, x, head, logits_chunk)


def embed(num: int, features: int, axes: tuple[str | None, str], *, dtype: Any, init_std: float, name: str) -> nn.Embed:
    """A float32 embedding table with logical axis names."""
    return nn.Embed(
        num,
        features,
        dtype=dtype,
        param_dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(init_std), axes),
        name=name,
    )


def rms_normalized(x: Array, epsilon: float) -> Array:
    """``x`` in float32 over the root mean square of its last axis: what HF's RMS norms compute before their weight
    (Llama 4's QK norm has none)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalise in float32, cast back, then multiply by the weight."""

    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), jnp.float32
        )
        x32 = rms_normalized(x, self.epsilon)
        return jnp.asarray(scale, self.dtype) * x32.astype(self.dtype)


def layer_norm(epsilon: float, *, dtype: Any, name: str) -> nn.LayerNorm:
    """torch-style LayerNorm (two-pass variance) with the epsilon from config.json and logical names."""
    return nn.LayerNorm(
        epsilon=epsilon,
        dtype=dtype,
        param_dtype=jnp.float32,
        use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
        name=name,
    )


def hf_config_dict(config: HFModelConfig, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The config's HF keys as a dict: without ``name``, the runtime options, ``lora`` and ``exclude``."""
    return config.model_dump(exclude={"name", "lora", *RUNTIME_KEYS, *exclude})


def token_positions(slots: Array, positions: Array | None, batch: int) -> Array:
    """``[B, T]`` positions for position embeddings / RoPE: the given ``positions`` (packed documents restart
    at 0), else the tokens' ``slots`` [T] (``0..T-1``, or their cache slots when decoding) for every row (a paged
    cache's ``[B, T]``: each row's own)."""
    return jnp.broadcast_to(slots if positions is None else positions, (batch, slots.shape[-1]))
