"""The mixture-of-experts layer: a router (Dense ``gate`` [hidden, E]) and ``E`` experts stacked one array per
projection, run by :mod:`functrain.models.moe.dispatch`, returning its output and the router's statistics.

Parameters (logical axes in brackets; ``expert`` is the axis expert parallelism shards)::

    gate/kernel            [hidden, E]            ("embed", None)      (+ gate/bias [E] with router_bias)
    experts/gate_proj      [E, hidden, inter]     ("expert", "embed", "mlp")
    experts/up_proj        [E, hidden, inter]     ("expert", "embed", "mlp")
    experts/down_proj      [E, inter, hidden]     ("expert", "mlp", "embed")
    experts/{gate,up}_proj_bias [E, inter], experts/down_proj_bias [E, hidden]   with expert_bias
    shared_expert/{gate,up,down}_proj/kernel    an always-on expert (Qwen2-MoE, DeepSeek), with shared_size
    shared_expert_gate/kernel [hidden, 1]       its sigmoid gate (Qwen2-MoE), with shared_gate

The family passes its router (:mod:`functrain.models.moe.routing`) and its gated activation ``glu(gate, up)``.
The statistics are sums over the real tokens (``token_mask``; every token when None), so that they add up
exactly over micro-batches and devices (:mod:`functrain.models.moe.balance` turns them into losses).
"""

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.hf_common import dense
from functrain.models.moe.dispatch import ExpertWeights, Glu, run_experts
from functrain.models.moe.routing import Router, Routing

Array = jax.Array


class RouterStats(NamedTuple):
    """One layer's router statistics as sums over its real tokens (stacked ``[L, ...]`` over a model's layers)."""

    counts: Array  # [E] selections of each expert (dropped ones included)
    prob_sums: Array  # [E] router probabilities summed over tokens (differentiable: the balancing loss's P)
    z_sums: Array  # [] squared logsumexp of the router logits, summed (the z-loss)
    tokens: Array  # [] real tokens routed; 0 on a layer without experts
    dropped: Array  # [] selections dropped by the capacity

    @classmethod
    def zeros(cls, num_experts: int) -> "RouterStats":
        """The statistics of a layer without experts (a dense MLP layer of a mixed stack)."""
        zero = jnp.zeros((), jnp.float32)
        return cls(jnp.zeros((num_experts,), jnp.float32), jnp.zeros((num_experts,), jnp.float32), zero, zero, zero)


def router_stats(routing: Routing, logits: Array, real: Array, dropped: Array) -> RouterStats:
    """One layer's :class:`RouterStats` from its ``routing`` of ``T`` tokens, the router's ``logits`` [T, E], the real
    tokens ``real`` (any shape of ``T`` elements: 1 on real tokens) and the selections ``dropped`` by a capacity."""
    real = real.reshape(-1)
    num_experts, top_k = logits.shape[-1], routing.experts.shape[-1]
    return RouterStats(
        counts=jnp.bincount(routing.experts.reshape(-1), weights=jnp.repeat(real, top_k), length=num_experts).astype(
            jnp.float32
        ),
        prob_sums=jnp.sum(routing.probs * real[:, None], axis=0),
        z_sums=jnp.sum(real * jnp.square(jax.nn.logsumexp(logits, axis=-1))),
        tokens=jnp.sum(real),
        dropped=jnp.sum(dropped),
    )


class Experts(nn.Module):
    """The stacked expert weights (see the module docstring)."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    use_bias: bool
    init_std: float

    @nn.compact
    def __call__(self) -> ExpertWeights:
        experts, hidden, inter = self.num_experts, self.hidden_size, self.intermediate_size
        kernel = nn.initializers.normal(self.init_std)

        def weight(name: str, shape: tuple[int, ...], axes: tuple[str, ...], init: Any = kernel) -> Any:
            return self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)

        biases: tuple[Array | None, ...] = (None, None, None)
        if self.use_bias:
            zeros = nn.initializers.zeros
            biases = (
                weight("gate_proj_bias", (experts, inter), ("expert", "mlp"), zeros),
                weight("up_proj_bias", (experts, inter), ("expert", "mlp"), zeros),
                weight("down_proj_bias", (experts, hidden), ("expert", "embed"), zeros),
            )
        return ExpertWeights(
            weight("gate_proj", (experts, hidden, inter), ("expert", "embed", "mlp")),
            weight("up_proj", (experts, hidden, inter), ("expert", "embed", "mlp")),
            weight("down_proj", (experts, inter, hidden), ("expert", "mlp", "embed")),
            *biases,
        )


class SharedExpert(nn.Module):
    """An expert every token takes: ``down(glu(gate(x), up(x)))``."""

    hidden_size: int
    intermediate_size: int
    glu: Glu
    init_std: float
    dtype: Any

    @nn.compact
    def __call__(self, x: Array) -> Array:
        def project(features: int, axes: tuple[str, str], name: str) -> nn.Dense:
            return dense(features, axes, use_bias=False, dtype=self.dtype, init_std=self.init_std, name=name)

        inter = self.intermediate_size
        hidden = self.glu(
            project(inter, ("embed", "mlp"), "gate_proj")(x), project(inter, ("embed", "mlp"), "up_proj")(x)
        )
        return project(self.hidden_size, ("mlp", "embed"), "down_proj")(hidden)


class MoeBlock(nn.Module):
    """``block(x[B, T, hidden], token_mask[B, T] | None) -> (y[B, T, hidden], RouterStats)``."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    router: Router
    glu: Glu
    dispatch: str = "grouped"  # "grouped" | "dense" (functrain.models.moe.dispatch)
    capacity_factor: float | None = None  # None: dropless
    expert_bias: bool = False
    router_bias: bool = False
    shared_size: int | None = None  # the width of an always-on shared expert (None: none)
    shared_gate: bool = False  # the shared expert's output scaled by sigmoid(x @ shared_expert_gate)
    scale_inputs: bool = False  # each chosen expert takes its token times its weight, its output unweighted (Llama 4)
    init_std: float = 0.02
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Array, token_mask: Array | None = None) -> tuple[Array, RouterStats]:
        batch, length, hidden = x.shape
        # The hidden states stay [B, T, hidden] (under context parallelism each device keeps the tokens it holds);
        # the router's narrow outputs are flattened to the [B * T] tokens the routers and statistics take.
        logits = dense(
            self.num_experts,
            ("embed", None),
            use_bias=self.router_bias,
            dtype=self.dtype,
            init_std=self.init_std,
            name="gate",
            fp8=False,  # routing decisions in train.compute_dtype (functrain.models.matmul)
        )(x).astype(jnp.float32)
        logits = logits.reshape(batch * length, self.num_experts)
        routing = self.router(logits)
        experts = Experts(
            self.num_experts, self.hidden_size, self.intermediate_size, self.expert_bias, self.init_std, name="experts"
        )()
        real = jnp.ones((batch, length), jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
        run = functools.partial(
            run_experts, w=experts, glu=self.glu, dispatch=self.dispatch, capacity_factor=self.capacity_factor
        )
        weights, chosen = routing.weights, routing.experts
        top_k = chosen.shape[1]
        if self.scale_inputs:
            # One row per (token, choice): the token scaled by the choice's weight, through that expert alone.
            rows = x[:, :, None, :] * weights.reshape(batch, length, top_k, 1).astype(x.dtype)
            per_row = functools.partial(jnp.reshape, shape=(batch, length * top_k, 1))
            out, dropped = run(
                rows.reshape(batch, length * top_k, hidden),
                per_row(jnp.ones_like(weights)),
                per_row(chosen),
                jnp.repeat(real, top_k, axis=1),
            )
            out = jnp.sum(out.reshape(batch, length, top_k, -1), axis=2)
        else:
            per_token = functools.partial(jnp.reshape, shape=(batch, length, -1))
            out, dropped = run(x, per_token(weights), per_token(chosen), real)
        if self.shared_size is not None:
            shared = SharedExpert(hidden, self.shared_size, self.glu, self.init_std, self.dtype, name="shared_expert")
            always = shared(x)
            if self.shared_gate:
                gate = dense(
                    1,
                    ("embed", None),
                    use_bias=False,
                    dtype=self.dtype,
                    init_std=self.init_std,
                    name="shared_expert_gate",
                )
                always = jax.nn.sigmoid(gate(x)) * always
            out = out + always.astype(out.dtype)
        return out.astype(x.dtype), router_stats(routing, logits, real, dropped)
