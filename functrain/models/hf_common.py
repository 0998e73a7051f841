"""Pieces shared by the HF-compatible models (GPT-2, Llama): config base, layers, position handling.

The maths follows the PyTorch reference implementations in `transformers` so that a converted checkpoint
gives the same logits to float32 precision; see `torch_bridge.hf` for the weight conversion. Attention is
:func:`functrain.models.attention.attend`; both models take optional ``segment_ids`` and ``positions``
[B, T] int32 for packed sequences (see :func:`token_positions`).
"""

from typing import Any, Callable, Iterable

import flax.linen as nn
import jax
import jax.numpy as jnp
import pydantic

from functrain.errors import ConfigError
from functrain.models.lora import LoraConfig
from functrain.models.options import RUNTIME_KEYS, RuntimeOptions

Array = jax.Array


class HFModelConfig(RuntimeOptions):
    """Base for model configs whose fields are named like the keys of an HF ``config.json`` (plus the
    runtime options ``attention``, ``remat`` and ``scan_layers``, which an HF config never sets)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # Special tokens are not used by the model but travel with it, so generation works after export.
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Fine-tuning with low-rank adapters (functrain.models.lora); not part of the HF config.
    lora: LoraConfig | None = None

    @pydantic.model_validator(mode="after")
    def _lora_unrolled(self):
        # Adapters are matched and saved per layer (PEFT's keys); they are not stacked for a scan.
        if self.lora is not None and self.scan_layers:
            raise ValueError("model.lora does not combine with model.scan_layers (adapters are per layer); "
                             "set model.scan_layers=false for LoRA fine-tuning")
        return self

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides: Any):
        """Build from an HF config dict, keeping only the keys this config knows (HF adds many more)."""
        known = {k: v for k, v in hf.items()
                 if k in cls.model_fields and k != "name" and k not in RUNTIME_KEYS and v is not None}
        known.update(overrides)
        try:
            return cls(**known)
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            where = f"{where}: " if where else ""
            raise ConfigError(f"config.json: {where}{message}; fix config.json") from None


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def _gelu_exact(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)


# HF activation names (transformers.activations.ACT2FN) that these models support.
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu": _gelu_exact,
    "relu": jax.nn.relu,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
}


def check_activation(name: str) -> str:
    """``name`` if it is a supported HF activation; a ValueError naming the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; use one of {', '.join(sorted(ACTIVATIONS))}")
    return name


def activation(name: str) -> Callable[[Array], Array]:
    """The activation function HF calls ``name``."""
    return ACTIVATIONS[check_activation(name)]


def dense(features: int, axes: tuple[str, str], *, use_bias: bool, dtype: Any, init_std: float,
          name: str) -> nn.Dense:
    """A float32 Dense layer whose kernel (and bias) carry logical axis names for sharding."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=jnp.float32,
        kernel_init=nn.with_logical_partitioning(nn.initializers.normal(init_std), axes),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes[1],)),
        name=name,
    )


def embed(num: int, features: int, axes: tuple[str | None, str], *, dtype: Any, init_std: float,
          name: str) -> nn.Embed:
    """A float32 embedding table with logical axis names."""
    return nn.Embed(
        num, features, dtype=dtype, param_dtype=jnp.float32,
        embedding_init=nn.with_logical_partitioning(nn.initializers.normal(init_std), axes), name=name)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalise in float32, cast back, then multiply by the weight."""

    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                           (x.shape[-1],), jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return jnp.asarray(scale, self.dtype) * x32.astype(self.dtype)


def layer_norm(epsilon: float, *, dtype: Any, name: str) -> nn.LayerNorm:
    """torch-style LayerNorm (two-pass variance) with the epsilon from config.json and logical names."""
    return nn.LayerNorm(
        epsilon=epsilon, dtype=dtype, param_dtype=jnp.float32, use_fast_variance=False,
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)), name=name)


def hf_config_dict(config: HFModelConfig, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The config's HF keys as a dict: without ``name``, the runtime options, ``lora`` and ``exclude``."""
    return config.model_dump(exclude={"name", "lora", *RUNTIME_KEYS, *exclude})


def token_positions(slots: Array, positions: Array | None, batch: int) -> Array:
    """``[B, T]`` positions for position embeddings / RoPE: the given ``positions`` (packed documents restart
    at 0), else the tokens' ``slots`` [T] (``0..T-1``, or their cache slots when decoding) for every row."""
    return jnp.broadcast_to(slots if positions is None else positions, (batch, slots.shape[0]))
