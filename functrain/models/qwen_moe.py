"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention (q/k/v biases; QK-norm and ``head_dim``) with experts on
the sparse layers (``decoder_sparse_step``, ``mlp_only_layers``) and Llama's MLP on the others. The router
softmaxes all ``num_experts`` logits and takes the top ``num_experts_per_tok``, renormalised with
``norm_topk_prob``; Qwen2-MoE adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.

The module is :class:`functrain.models.moe.decoder.MoeForCausalLM` with :func:`feed_forward`.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.models import llama, qwen2
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.configs.qwen_moe import Qwen2MoeConfig, Qwen3MoeConfig
from functrain.models.moe.decoder import MoeForCausalLM, build_decoder, gated
from functrain.models.moe.layer import MoeBlock
from functrain.models.moe.routing import softmax_topk

QwenMoeConfig = Qwen2MoeConfig | Qwen3MoeConfig


def _sliding_layers(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen2-MoE's windows as transformers derives them: ``layer_types`` when given, else every other layer
    below ``max_window_layers`` (first, third, ...) with ``use_sliding_window``."""
    if hf.get("layer_types") is None and hf.get("use_sliding_window", False):
        layers = int(hf.get("num_hidden_layers", 0))
        below = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if (i + 1) % 2 and i < below else "full_attention" for i in range(layers)]
        hf = {**hf, "layer_types": types}
    return qwen2.sliding_layer_settings(hf)


def qwen2_moe_from_hf_config(hf: dict[str, Any]) -> Qwen2MoeConfig:
    """Qwen2MoeConfig from an HF config.json dict."""
    return llama.config_from_hf(Qwen2MoeConfig, {**hf, **_sliding_layers(hf)}, qkv_bias_=hf.get("qkv_bias", True))


def qwen2_moe_to_hf_config(config: Qwen2MoeConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen2MoeForCausalLM."""
    return llama.config_to_hf(
        config,
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        exclude={"attention_bias", "mlp_bias", "qkv_bias_", *MOE_RUNTIME_KEYS},
        qkv_bias=config.qkv_bias,
        **qwen2.hf_sliding_layer_keys(config),
    )


def qwen3_moe_from_hf_config(hf: dict[str, Any]) -> Qwen3MoeConfig:
    """Qwen3MoeConfig from an HF config.json dict: ``sliding_window`` on every layer with ``use_sliding_window``."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    layers = int(hf.get("num_hidden_layers", 0))
    types = ("sliding_attention" if window is not None else "full_attention",) * layers
    # The hub's configs say num_experts; transformers 5 writes it as num_local_experts (its attribute map).
    experts = {"num_experts": hf["num_local_experts"]} if "num_local_experts" in hf else {}
    return llama.config_from_hf(Qwen3MoeConfig, {**hf, **experts, "sliding_window": window, "layer_types": types})


def qwen3_moe_to_hf_config(config: Qwen3MoeConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3MoeForCausalLM."""
    return llama.config_to_hf(
        config,
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        exclude={"mlp_bias", "layer_types", *MOE_RUNTIME_KEYS},
        use_sliding_window=config.sliding_window is not None,
        num_local_experts=config.num_experts,  # what transformers 5 writes; num_experts for older readers
    )


def feed_forward(config: QwenMoeConfig, dtype: Any, layer: int, name: str) -> nn.Module:
    """The layer's experts (with Qwen2-MoE's gated shared expert), or Llama's MLP on a dense layer."""
    if not config.moe_layer(layer):
        return llama.LlamaMLP(config, dtype, name=name)
    shared = config.shared_expert_size()
    return MoeBlock(
        num_experts=config.num_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        router=functools.partial(softmax_topk, top_k=config.num_experts_per_tok, normalize=config.norm_topk_prob),
        glu=gated(config.hidden_act),
        dispatch=config.moe_dispatch,
        capacity_factor=config.capacity_factor,
        shared_size=shared or None,
        shared_gate=bool(shared),
        init_std=config.initializer_range,
        dtype=dtype,
        name=name,
    )


def build(config: QwenMoeConfig, dtype: Any = jnp.float32) -> MoeForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32)."""
    return build_decoder(config, feed_forward, dtype)
