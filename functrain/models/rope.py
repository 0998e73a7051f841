"""Rotary position embeddings as HF computes them: default, ``linear``, ``dynamic``, ``yarn``, ``llama3`` and
``longrope`` (Phi-3).

Frequencies follow ``transformers.modeling_rope_utils`` in float32 so that converted checkpoints give the same
logits. ``dynamic`` (NTK) and ``longrope`` depend on the sequence length, so their frequencies are computed from
the positions at run time (HF switches them once a sequence outgrows ``max_position_embeddings``, or
``original_max_position_embeddings`` for longrope's long factors); the others are constants.
"""

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functrain.models.configs.rope import REQUIRED_KEYS, RopeScaling


def _base_frequencies(theta: float | jax.Array, dim: int, xp: Any = np) -> Any:
    exponents = xp.arange(0, dim, 2, dtype=xp.float32) / xp.float32(dim)
    return 1.0 / (xp.asarray(theta, xp.float32) ** exponents)


def _llama3(inv_freq: np.ndarray, scaling: RopeScaling) -> np.ndarray:
    # Llama 3.x: slow down low frequencies by `factor`, blend smoothly in the medium band.
    assert (
        scaling.factor is not None
        and scaling.low_freq_factor is not None
        and scaling.high_freq_factor is not None
        and scaling.original_max_position_embeddings is not None
    ), "set: RopeScaling requires them for llama3"
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``scale`` times longer (1 when not longer)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, scaling: RopeScaling) -> tuple[np.ndarray, float]:
    factor, original = scaling.factor, scaling.original_max_position_embeddings
    assert factor is not None and original is not None, "set: RopeScaling requires them for yarn"

    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = (
            yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
            if scaling.mscale and scaling.mscale_all_dim
            else yarn_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast or 32), correction_dim(scaling.beta_slow or 1)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = 1 - ramp.astype(np.float32)
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (1.0 / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def _longrope(config: Any, positions: jax.Array) -> tuple[jax.Array, float]:
    # Per-frequency rescaling: the short factors up to original_max_position_embeddings, the long ones beyond.
    scaling, dim = config.rope_scaling, config.attn_head_dim
    original = scaling.original_max_position_embeddings
    factor = scaling.factor or config.max_position_embeddings / original
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    wavelengths = np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    short = (1.0 / (np.asarray(scaling.short_factor, np.float32) * wavelengths)).astype(np.float32)
    long = (1.0 / (np.asarray(scaling.long_factor, np.float32) * wavelengths)).astype(np.float32)
    return jnp.where(jnp.max(positions) + 1 > original, long, short), float(attention_factor)


def frequencies(config: Any, positions: jax.Array) -> tuple[Any, float]:
    """``(inverse frequencies [D/2], cos/sin scale)`` for ``config`` (``rope_theta``, ``rope_scaling``,
    ``attn_head_dim``, ``max_position_embeddings``) at ``positions`` (only ``dynamic`` looks at them)."""
    theta, dim, scaling = config.rope_theta, config.attn_head_dim, config.rope_scaling
    if scaling is None:
        return _base_frequencies(theta, dim).astype(np.float32), 1.0
    if scaling.rope_type == "linear":
        return (_base_frequencies(theta, dim) / np.float32(scaling.factor)).astype(np.float32), 1.0
    if scaling.rope_type == "llama3":
        return _llama3(_base_frequencies(theta, dim), scaling).astype(np.float32), 1.0
    if scaling.rope_type == "yarn":
        return _yarn(theta, dim, scaling)
    if scaling.rope_type == "longrope":
        return _longrope(config, positions)
    # dynamic NTK: a larger base once the sequence is longer than max_position_embeddings.
    max_len = config.max_position_embeddings
    seq_len = jnp.maximum(jnp.max(positions) + 1, max_len).astype(jnp.float32)
    base = theta * ((scaling.factor * seq_len / max_len) - (scaling.factor - 1)) ** (dim / (dim - 2))
    return _base_frequencies(base, dim, jnp), 1.0


def apply_rope(x: jax.Array, inv_freq: Any, positions: jax.Array | None = None, scale: float = 1.0) -> jax.Array:
    """Rotate x [B, T, H, D] by position (``[T]`` or ``[B, T]``, default ``0..T-1``) using HF's rotate-half
    layout (first half pairs with second); ``scale`` multiplies cos and sin (yarn's attention factor). With
    fewer than ``D / 2`` frequencies only the leading ``2 * len(inv_freq)`` features rotate and the others pass
    through (HF's ``partial_rotary_factor``, GLM)."""
    rotary = 2 * jnp.shape(inv_freq)[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], inv_freq, positions, scale), x[..., rotary:]], axis=-1)
    positions = jnp.arange(x.shape[1]) if positions is None else positions
    positions = jnp.broadcast_to(positions, x.shape[:2])
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = (jnp.cos(angles) * scale).astype(x.dtype), (jnp.sin(angles) * scale).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def parse_hf_rope(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Split an HF config dict's rope settings (old ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``)
    into (the dict without them plus ``rope_theta``, the scaling dict or None for the default type)."""
    hf = dict(hf)
    parameters, legacy_scaling = hf.pop("rope_parameters", None), hf.pop("rope_scaling", None)
    rope = dict(parameters or legacy_scaling or {})
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if "rope_theta" in rope:
        hf["rope_theta"] = rope.pop("rope_theta")
    partial = rope.pop("partial_rotary_factor", None) or hf.pop("partial_rotary_factor", None) or 1.0
    if partial != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type not in ("default", *REQUIRED_KEYS):
        raise ValueError(f"rope type {rope_type!r} is not supported; use one of default, {', '.join(REQUIRED_KEYS)}")
    if rope_type == "default":
        if rope:
            raise ValueError(f"rope type 'default' does not implement {', '.join(sorted(rope))}")
        return hf, None
    return hf, {"rope_type": rope_type, **rope}


def hf_rope_parameters(config: Any) -> dict[str, Any]:
    """The transformers 5 ``rope_parameters`` dict for ``config``."""
    rope = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope.update(config.rope_scaling.model_dump(exclude_none=True))
    return rope
