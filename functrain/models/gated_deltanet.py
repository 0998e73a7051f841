"""Gated DeltaNet as a layer of a decoder (Qwen3-Next's and Qwen3.5's ``linear_attn``), with the maths and parameter
names of transformers' ``Qwen3NextGatedDeltaNet`` / ``Qwen3_5GatedDeltaNet``.

``x`` [B, T, hidden] is projected to queries and keys (``linear_num_key_heads`` of ``linear_key_head_dim``), values
and an output gate ``z`` (``linear_num_value_heads`` of ``linear_value_head_dim``), and per value head a write
strength ``beta = sigmoid(b)`` and a decay ``g = -exp(A_log) * softplus(a + dt_bias)``. Queries, keys and values
pass a short depthwise causal convolution (``linear_conv_kernel_dim`` taps) and the activation, then the gated
delta rule (:mod:`functrain.models.delta_rule`: chunks of ``linear_chunk_size`` tokens, by XLA or, with
``gdn_kernel: pallas``, by the TPU kernel of :mod:`functrain.models.delta_rule_pallas`); the result is
RMS-normalised per head, gated by ``silu(z)`` and projected back by ``out_proj``.

Parameters (transformers' names)::

    in_proj_qkv, in_proj_z, in_proj_b, in_proj_a  Dense kernels (Qwen3.5), or
    in_proj_qkvz, in_proj_ba                      Qwen3-Next's fused ones (grouped by key head, as transformers
                                                  lays them out)
    conv1d/kernel [C, 1, K]                       transformers' conv1d.weight (C: the q, k and v channels)
    A_log, dt_bias [Hv]; norm/scale [Dv]; out_proj

Packed sequences: with ``segment_ids`` [B, T] the convolution and the state both start afresh at each document.
Decoding (:mod:`functrain.models.kv_cache`: applied with ``mutable=["cache"]`` and frozen params) keeps in the
``cache`` collection the convolution's last ``K - 1`` inputs (``conv_state``) and the delta rule's state
(``recurrent_state`` [B, Hv, Dk, Dv], float32) beside the attention layers' keys and values: a prompt runs in chunks
from them, a single token by the recurrent form.
"""

import dataclasses
from typing import Any, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.configs.qwen3_next import GdnKernel
from functrain.models.delta_rule import causal_conv, document_runs, recurrent_delta_rule
from functrain.models.delta_rule_pallas import delta_rule_kernel
from functrain.models.hf_common import activation, dense, rms_normalized
from functrain.models.kv_cache import decoding

Array = jax.Array


class GatedDeltaNetConfig(Protocol):
    """What :class:`GatedDeltaNet` reads from a config (HF's keys, and functrain's ``linear_chunk_size`` and
    ``gdn_kernel``)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def hidden_act(self) -> str: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def initializer_range(self) -> float: ...
    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def linear_chunk_size(self) -> int: ...
    @property
    def fused_linear_projections(self) -> bool: ...
    @property
    def gdn_kernel(self) -> GdnKernel: ...


def _uniform_log(low: float, high: float) -> Any:
    """transformers' ``A_log`` init: the log of a uniform draw in [low, high)."""
    return lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, low, high))


class GatedRMSNorm(nn.Module):
    """transformers' ``Qwen3NextRMSNormGated``: ``weight * norm(x)`` in the compute dtype, times ``silu(gate)``."""

    epsilon: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, gate: Array) -> Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (x.shape[-1],), jnp.float32
        )
        x32 = rms_normalized(x, self.epsilon)
        normed = jnp.asarray(scale, self.dtype) * x32.astype(self.dtype)
        return (normed.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(self.dtype)


class _ConvKernel(nn.Module):
    """The depthwise convolution's taps (transformers' ``conv1d``): ``kernel`` [C, 1, K] as stored, returned as
    [K, C]."""

    taps: int
    channels: int
    init_std: float

    @nn.compact
    def __call__(self) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ("heads", None, None))
        return nn.meta.unbox(self.param("kernel", init, (self.channels, 1, self.taps), jnp.float32))[:, 0].T


@dataclasses.dataclass(frozen=True)
class _Cache:
    """A layer's decoding state: no variables outside decoding; ``primed`` once they hold a sequence's state (not in
    the apply that only takes their shapes, :func:`functrain.models.kv_cache.empty_cache`)."""

    conv: Any  # flax Variable [B, K - 1, C] in the compute dtype, or None
    recurrent: Any  # flax Variable [B, Hv, Dk, Dv] float32, or None
    primed: bool

    @classmethod
    def of(cls, module: nn.Module, conv: jax.ShapeDtypeStruct, state_shape: tuple[int, ...]) -> "_Cache":
        """The variables of ``module``'s state (``conv``: the convolution's past inputs)."""
        if not decoding(module):
            return cls(None, None, False)
        primed = module.has_variable("cache", "recurrent_state")
        past = module.variable("cache", "conv_state", jnp.zeros, conv.shape, conv.dtype)
        recurrent = module.variable("cache", "recurrent_state", jnp.zeros, state_shape, jnp.float32)
        return cls(past, recurrent, primed)

    def conv_input(self) -> Array | None:
        """The inputs before this call's tokens (None: a sequence's start)."""
        return self.conv.value if self.primed else None

    def state_input(self) -> Array | None:
        """The delta rule's state before this call's tokens (None: a sequence's start)."""
        return self.recurrent.value if self.primed else None

    def update(self, conv_tail: Array, state: Array) -> None:
        """Keep the states after this call's tokens for the next call."""
        if self.primed:
            self.conv.value, self.recurrent.value = conv_tail, state


class GatedDeltaNet(nn.Module):
    """``layer(x[B, T, hidden], segment_ids=None) -> [B, T, hidden]`` (see the module docstring)."""

    config: GatedDeltaNetConfig
    dtype: Any = jnp.float32

    def _projections(self, x: Array) -> tuple[Array, Array, Array, Array]:
        """``(q, k, v channels [B, T, C] before the convolution, z [B, T, Hv, Dv], b, a [B, T, Hv])``."""
        cfg = self.config
        key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        key_dim, value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        batch, length, _ = x.shape

        def project(features: int, name: str) -> Array:
            return dense(
                features,
                ("embed", "heads"),
                use_bias=False,
                dtype=self.dtype,
                init_std=cfg.initializer_range,
                name=name,
            )(x)

        if not cfg.fused_linear_projections:
            mixed = project(2 * key_heads * key_dim + value_heads * value_dim, "in_proj_qkv")
            z = project(value_heads * value_dim, "in_proj_z").reshape(batch, length, value_heads, value_dim)
            return mixed, z, project(value_heads, "in_proj_b"), project(value_heads, "in_proj_a")
        # Qwen3-Next groups its fused projections by key head: [q, k, the group's v, the group's z] and [b, a].
        group = value_heads // key_heads
        qkvz = project(key_heads * (2 * key_dim + 2 * group * value_dim), "in_proj_qkvz")
        qkvz = qkvz.reshape(batch, length, key_heads, -1)
        q, k, v, z = jnp.split(qkvz, [key_dim, 2 * key_dim, 2 * key_dim + group * value_dim], axis=-1)
        b, a = jnp.split(project(2 * value_heads, "in_proj_ba").reshape(batch, length, key_heads, -1), 2, axis=-1)
        mixed = jnp.concatenate([part.reshape(batch, length, -1) for part in (q, k, v)], axis=-1)
        by_head = (batch, length, value_heads)
        return mixed, z.reshape(*by_head, value_dim), b.reshape(by_head), a.reshape(by_head)

    @nn.compact
    def __call__(self, x: Array, segment_ids: Array | None = None) -> Array:
        cfg = self.config
        key_heads, value_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        key_dim, value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        batch, length, _ = x.shape
        channels = 2 * key_heads * key_dim + value_heads * value_dim
        mixed, z, b, a = self._projections(x)

        def weight(name: str, init: Any, shape: tuple[int, ...], axes: tuple[str | None, ...]) -> Array:
            return nn.meta.unbox(self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32))

        kernel = _ConvKernel(cfg.linear_conv_kernel_dim, channels, cfg.initializer_range, name="conv1d")()
        a_log = weight("A_log", _uniform_log(0.01, 16.0), (value_heads,), ("heads",))
        dt_bias = weight("dt_bias", nn.initializers.ones, (value_heads,), ("heads",))

        runs = None if segment_ids is None else document_runs(segment_ids, length, batch)
        past_inputs = jax.ShapeDtypeStruct((batch, kernel.shape[0] - 1, channels), self.dtype)
        cache = _Cache.of(self, past_inputs, (batch, value_heads, key_dim, value_dim))
        mixed, conv_tail = causal_conv(mixed, kernel.astype(self.dtype), runs=runs, state=cache.conv_input())
        mixed = activation(cfg.hidden_act)(mixed)
        q, k, v = jnp.split(mixed, [key_heads * key_dim, 2 * key_heads * key_dim], axis=-1)
        q, k = (part.reshape(batch, length, key_heads, key_dim) for part in (q, k))
        v = v.reshape(batch, length, value_heads, value_dim)
        beta = jax.nn.sigmoid(b)
        decay = -jnp.exp(a_log) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias)
        initial = cache.state_input()
        if initial is not None and length == 1:
            out, state = recurrent_delta_rule(q, k, v, decay, beta, initial_state=initial)
        else:
            out, state = delta_rule_kernel(cfg.gdn_kernel)(
                q, k, v, decay, beta, chunk_size=cfg.linear_chunk_size, runs=runs, initial_state=initial
            )
        cache.update(conv_tail, state)
        out = GatedRMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(out.astype(self.dtype), z)
        return dense(
            cfg.hidden_size,
            ("heads", "embed"),
            use_bias=False,
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="out_proj",
        )(out.reshape(batch, length, value_heads * value_dim))
