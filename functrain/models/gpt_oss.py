"""GPT-OSS as a Flax module with the maths of HF's ``GptOssForCausalLM``.

Llama's attention (:class:`functrain.models.llama.LlamaAttention`) with biases on every projection, a learned
sink logit per query head (:func:`functrain.models.attention.attend`'s ``sinks``), sliding-window and full layers
alternating as ``layer_types`` says and YaRN RoPE; in place of the MLP a mixture of experts
(:class:`functrain.models.moe.layer.MoeBlock`) whose biased router softmaxes its top ``num_experts_per_tok``
logits (:func:`topk_softmax`) and whose biased experts apply the clamped SwiGLU (:func:`clamped_swiglu`).

transformers stores each layer's gate and up projections fused and interleaved (``experts.gate_up_proj``
[E, hidden, 2 x inter]: gate at even columns, up at odd ones); here they are the MoE layer's separate stacked
``gate_proj`` and ``up_proj`` (:mod:`torch_bridge.hf.mappings` splits and rejoins them).
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models import llama
from functrain.models.configs.gpt_oss import GptOssConfig
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.moe.decoder import MoeForCausalLM, build_decoder
from functrain.models.moe.layer import MoeBlock
from functrain.models.moe.routing import Routing

Array = jax.Array
# The one quantization the released checkpoints use; torch_bridge.hf.mxfp4 dequantizes it on load.
QUANT_METHODS = ("mxfp4",)


def from_hf_config(hf: dict[str, Any]) -> GptOssConfig:
    """GptOssConfig from an HF config.json dict (the released MXFP4 checkpoints' included)."""
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method is not None and method not in QUANT_METHODS:
        raise ConfigError(
            f"config.json: quantization_config.quant_method {method!r} is not supported for gpt_oss "
            f"(only {', '.join(QUANT_METHODS)}, dequantized on load); convert an unquantized or MXFP4 checkpoint"
        )
    return llama.config_from_hf(GptOssConfig, hf)


def to_hf_config(config: GptOssConfig) -> dict[str, Any]:
    """An HF config.json dict (unquantized) that loads as GptOssForCausalLM."""
    return llama.config_to_hf(
        config,
        "gpt_oss",
        "GptOssForCausalLM",
        exclude={"mlp_bias", "layer_types", *MOE_RUNTIME_KEYS},
        layer_types=list(config.hf_layer_types()),
    )


def topk_softmax(logits: Array, top_k: int) -> Routing:
    """GPT-OSS's routing: the ``top_k`` largest (biased) logits, softmaxed among themselves; the balancing loss
    sees the softmax of all of them (transformers' ``load_balancing_loss_func``)."""
    logits = logits.astype(jnp.float32)
    top, experts = jax.lax.top_k(logits, top_k)
    return Routing(jax.nn.softmax(top, axis=-1), experts.astype(jnp.int32), jax.nn.softmax(logits, axis=-1))


def clamped_swiglu(gate: Array, up: Array, alpha: float, limit: float) -> Array:
    """``(up + 1) * gate * sigmoid(alpha * gate)`` with the gate clamped above at ``limit`` and ``up`` to
    ``[-limit, limit]`` (transformers' ``GptOssExperts._apply_gate``)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


@functools.cache
def _glu(alpha: float, limit: float) -> Any:
    # One function per setting, so modules built from equal configs compare equal.
    return functools.partial(clamped_swiglu, alpha=alpha, limit=limit)


@functools.cache
def _router(top_k: int) -> Any:
    return functools.partial(topk_softmax, top_k=top_k)


def experts(config: GptOssConfig, dtype: Any, layer: int, name: str) -> nn.Module:
    """GPT-OSS's mixture of experts (every layer): a biased router, biased experts, the clamped SwiGLU."""
    return MoeBlock(
        num_experts=config.num_local_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        router=_router(config.num_experts_per_tok),
        glu=_glu(config.swiglu_alpha, config.swiglu_limit),
        dispatch=config.moe_dispatch,
        capacity_factor=config.capacity_factor,
        expert_bias=True,
        router_bias=True,
        init_std=config.initializer_range,
        dtype=dtype,
        name=name,
    )


def build(config: GptOssConfig, dtype: Any = jnp.float32) -> MoeForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32)."""
    return build_decoder(config, experts, dtype)
