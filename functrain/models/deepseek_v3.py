"""DeepSeek-V3 as a Flax module with the maths of HF's ``DeepseekV3ForCausalLM``.

Each layer is pre-RMSNorm: multi-head latent attention (:mod:`functrain.models.mla`), then a SwiGLU MLP of
``intermediate_size`` on the first ``first_k_dense_replace`` layers and a mixture of experts on the others.

Parameters: the dense layers are ``dense_layers_{i}`` and the MoE layers ``moe_layers_{j}`` (HF's layer
``first_k_dense_replace + j``): two runs of identical layers, so ``model.scan_layers`` scans each as one stack
(``dense_layers_stack``, ``moe_layers_stack``), as MaxText does.
"""

from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models import llama
from functrain.models.attention import attention_kernel
from functrain.models.configs.deepseek_v3 import DeepseekV3Config
from functrain.models.hf_common import RMSNorm, dense, embed, hf_config_dict
from functrain.models.mla import LatentAttention
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import hf_rope_parameters, parse_hf_rope
from functrain.models.scan import apply_layers
from functrain.parallel.sharding import constrain_batch

DENSE_PREFIX, MOE_PREFIX = "dense_layers_", "moe_layers_"
# Keys of the original DeepSeek config.json (trust_remote_code) naming what V3 is; anything else is another model.
_DEEPSEEK_V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def from_hf_config(hf: dict[str, Any]) -> DeepseekV3Config:
    """DeepseekV3Config from an HF config.json dict (transformers' or the original release's keys)."""
    for key, value in _DEEPSEEK_V3_ROUTING.items():
        if key in hf and hf[key] != value:
            raise ConfigError(
                f"config.json: {key} {hf[key]!r} is not DeepSeek-V3's ({value!r}); only DeepSeek-V3's routing is "
                f"supported; fix config.json"
            )
    try:
        hf, scaling = parse_hf_rope(hf)
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for deepseek_v3; fix config.json") from None
    overrides: dict[str, Any] = {"rope_scaling": scaling} if scaling else {}
    if "q_lora_rank" in hf:  # null means queries without the low-rank bottleneck, not the default rank
        overrides["q_lora_rank"] = hf["q_lora_rank"]
    return DeepseekV3Config.from_hf_dict(hf, **overrides)


def to_hf_config(config: DeepseekV3Config) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as DeepseekV3ForCausalLM."""
    hf = hf_config_dict(config, exclude={"rope_theta", "rope_scaling"})
    hf.update(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=config.num_attention_heads,
        rope_parameters=hf_rope_parameters(config),
        num_nextn_predict_layers=0,  # functrain has no multi-token-prediction layer to export
        attention_dropout=0.0,
        pretraining_tp=1,
    )
    return hf


@dataclass(frozen=True)
class MLPShape:
    """What :class:`functrain.models.llama.LlamaMLP` reads, for DeepSeek's dense and shared-expert MLPs."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str
    initializer_range: float
    mlp_bias: bool = False


def dense_mlp_shape(config: DeepseekV3Config) -> MLPShape:
    """The dense layers' MLP (``intermediate_size`` wide)."""
    return MLPShape(config.hidden_size, config.intermediate_size, config.hidden_act, config.initializer_range)


class DeepseekV3Block(nn.Module):
    """One pre-RMSNorm decoder layer: latent attention, then the dense MLP or the mixture of experts."""

    config: DeepseekV3Config
    dtype: Any
    moe: bool = False

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None):
        cfg = self.config
        eps = cfg.rms_norm_eps
        x = x + LatentAttention(cfg, self.dtype, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), segment_ids, positions
        )
        hidden = RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x)
        if self.moe:
            raise NotImplementedError  # replaced by the mixture of experts on functrain.models.moe
        return x + llama.LlamaMLP(dense_mlp_shape(cfg), self.dtype, name="mlp")(hidden)


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 language model: ``apply({"params": p}, input_ids[B, T])`` -> float32 logits [B, T, vocab]."""

    config: DeepseekV3Config
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None):
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here);
        ``segment_ids`` / ``positions`` [B, T]: packed documents (as :mod:`functrain.models.llama`)."""
        cfg = self.config
        std = cfg.initializer_range
        tokens = embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"), dtype=self.dtype, init_std=std,
                       name="embed_tokens")  # fmt: skip
        x = constrain_batch(tokens(input_ids))
        block = remat_block(DeepseekV3Block, cfg.remat, prevent_cse=not cfg.scan_layers)
        runs = ((False, cfg.dense_layers, DENSE_PREFIX), (True, cfg.num_hidden_layers - cfg.dense_layers, MOE_PREFIX))
        for moe, count, prefix in (run for run in runs if run[1]):

            def make_block(i: int, name: str, moe: bool = moe) -> nn.Module:
                return block(cfg, self.dtype, moe, name=name)

            x = apply_layers(
                x, kinds=[moe] * count, make_block=make_block, prefix=prefix, scan=cfg.scan_layers,
                args=(segment_ids, positions),
            )  # fmt: skip
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        if cfg.tie_word_embeddings:
            logits = tokens.attend(x)
        else:
            logits = dense(cfg.vocab_size, ("embed", "vocab"), use_bias=False, dtype=self.dtype, init_std=std,
                           name="lm_head")(x)  # fmt: skip
        return logits.astype(jnp.float32)


def hf_layer_path(config: DeepseekV3Config, layer: int) -> str:
    """The functrain module of HF's ``model.layers.{layer}`` (unrolled)."""
    if config.is_moe_layer(layer):
        return f"{MOE_PREFIX}{layer - config.dense_layers}"
    return f"{DENSE_PREFIX}{layer}"


def build(config: DeepseekV3Config, dtype: Any = jnp.float32) -> DeepseekV3ForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, max(config.qk_head_dim, config.v_head_dim))
    check_remat(config.remat)
    return DeepseekV3ForCausalLM(config, dtype=dtype)


MODEL_SPEC = dict(config_cls=DeepseekV3Config, build=build, kind="causal_lm")
