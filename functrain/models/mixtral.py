"""Mixtral: Mistral's attention (no biases, an optional ``sliding_window`` on every layer) with a mixture of
experts in every layer: a softmax over the router's logits, the top ``num_experts_per_tok`` renormalised
(transformers' ``MixtralTopKRouter``, the same as a softmax of the top-k logits), SwiGLU experts.

The module is :class:`functrain.models.moe.decoder.MoeForCausalLM` with the experts of
:class:`functrain.models.moe.layer.MoeBlock`.
"""

import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.models import llama
from functrain.models.configs.mixtral import MixtralConfig
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.moe.decoder import MoeForCausalLM, build_decoder, gated
from functrain.models.moe.layer import MoeBlock
from functrain.models.moe.routing import softmax_topk


def from_hf_config(hf: dict[str, Any]) -> MixtralConfig:
    """MixtralConfig from an HF config.json dict."""
    return llama.config_from_hf(MixtralConfig, hf)


def to_hf_config(config: MixtralConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as MixtralForCausalLM."""
    return llama.config_to_hf(
        config, "mixtral", "MixtralForCausalLM", exclude={"attention_bias", "mlp_bias", *MOE_RUNTIME_KEYS}
    )


def experts(config: MixtralConfig, dtype: Any, layer: int, name: str) -> nn.Module:
    """Mixtral's sparse block (every layer)."""
    return MoeBlock(
        num_experts=config.num_local_experts,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        router=functools.partial(softmax_topk, top_k=config.num_experts_per_tok, normalize=True),
        glu=gated(config.hidden_act),
        dispatch=config.moe_dispatch,
        capacity_factor=config.capacity_factor,
        init_std=config.initializer_range,
        dtype=dtype,
        name=name,
    )


def build(config: MixtralConfig, dtype: Any = jnp.float32) -> MoeForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32)."""
    return build_decoder(config, experts, dtype)
