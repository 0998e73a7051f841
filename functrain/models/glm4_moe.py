"""GLM-4.5 (HF ``Glm4MoeForCausalLM``, model_type ``glm4_moe``): DeepSeek-V3's decoder
(:mod:`functrain.models.deepseek_v3`: dense first layers, then ``n_routed_experts`` experts chosen by sigmoid
scores plus a correction bias within groups, and shared experts) with Llama's grouped-query attention in place of
the latent attention: biases on q, k and v with ``attention_bias`` (never on ``o_proj``), optional RMSNorm on
each query and key head (``use_qk_norm``), and a rotary embedding over the leading ``partial_rotary_factor`` of
each head's features.

Checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction layers past ``num_hidden_layers``: the model
trains them and conversion keeps them, as DeepSeek-V3's does (:mod:`functrain.models.mtp`).
"""

from typing import Any

import jax.numpy as jnp

from functrain.models import llama
from functrain.models.attention import attention_kernel
from functrain.models.configs.deepseek_moe import DEEPSEEK_RUNTIME_KEYS
from functrain.models.configs.glm4_moe import Glm4MoeConfig
from functrain.models.configs.hf import NO_DROPOUT, refuse_unimplemented
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.deepseek_v3 import DeepseekV3ForCausalLM
from functrain.models.remat import check_remat

# transformers' defaults where config.json leaves these out (its head_dim: hidden_size // num_attention_heads).
_HF_DEFAULTS = {"hidden_size": 4096, "num_attention_heads": 96, "partial_rotary_factor": 0.5}


def from_hf_config(hf: dict[str, Any]) -> Glm4MoeConfig:
    """Glm4MoeConfig from an HF config.json dict (v5 ``rope_parameters`` or the released layout's top-level
    ``rope_theta``/``partial_rotary_factor``); a setting it does not implement is named."""
    refuse_unimplemented(hf, "glm4_moe", NO_DROPOUT)
    hf = dict(hf)
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = dict(hf.get(rope_key) or {})
    top_level = hf.pop("partial_rotary_factor", None)
    factor = rope.pop("partial_rotary_factor", None) or top_level or _HF_DEFAULTS["partial_rotary_factor"]
    hf[rope_key] = rope or None
    heads = hf.get("num_attention_heads") or _HF_DEFAULTS["num_attention_heads"]
    head_dim = hf.get("head_dim") or (hf.get("hidden_size") or _HF_DEFAULTS["hidden_size"]) // heads
    return llama.config_from_hf(Glm4MoeConfig, hf, partial_rotary_factor=factor, head_dim=head_dim)


def to_hf_config(config: Glm4MoeConfig) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as Glm4MoeForCausalLM."""
    hf = llama.config_to_hf(
        config,
        "glm4_moe",
        "Glm4MoeForCausalLM",
        exclude={"mlp_bias", "partial_rotary_factor", *DEEPSEEK_RUNTIME_KEYS, *MOE_RUNTIME_KEYS},
    )
    hf["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
    return hf


def build(config: Glm4MoeConfig, dtype: Any = jnp.float32) -> DeepseekV3ForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.attn_head_dim)
    check_remat(config.remat)
    return DeepseekV3ForCausalLM(config, dtype=dtype, attention=llama.LlamaAttention)
