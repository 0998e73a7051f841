"""Qwen3-Next and Qwen3.5 as a Flax module with the maths of transformers' ``Qwen3NextForCausalLM``,
``Qwen3_5ForCausalLM`` and ``Qwen3_5MoeForCausalLM``.

A hybrid stack: each layer mixes tokens by Gated DeltaNet (``linear_attention``, :mod:`functrain.models.gated_deltanet`)
or by gated full attention (``full_attention``, :mod:`functrain.models.gated_attention`), as ``layer_types`` says
(by default three of one, then one of the other), then by a SwiGLU MLP or a mixture of experts with a gated shared
expert (:mod:`functrain.models.moe`); RMSNorm around one (weights stored zero-centred) before both and at the end.
``model.scan_layers`` scans the repeating group of layers (three Gated DeltaNet layers and one attention layer).

``HybridForCausalLM(config)(input_ids[B, T], segment_ids=None, positions=None, token_mask=None)``: packed sequences
as for Llama (the Gated DeltaNet layers restart their state at each document), ``token_mask`` for the experts'
statistics (a mixture of experts returns a :class:`~functrain.core.model_output.ModelOutput`, a dense model its
logits). Decoding keeps each attention layer's keys and values and each Gated DeltaNet layer's states in the cache.
"""

from typing import Any, TypeVar

import flax.linen as nn
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models import qwen_moe
from functrain.models.attention import attention_kernel
from functrain.models.configs.moe import MOE_RUNTIME_KEYS, MoeOptions
from functrain.models.configs.qwen3_next import FULL_ATTENTION_INTERVAL, HybridConfig, Qwen3NextConfig
from functrain.models.gated_attention import GatedAttention
from functrain.models.gated_deltanet import GatedDeltaNet
from functrain.models.gemma2 import GemmaRMSNorm
from functrain.models.hf_common import embed, hf_config_dict, lm_head
from functrain.models.llama import LlamaMLP
from functrain.models.moe.balance import moe_output
from functrain.models.moe.decoder import balancing
from functrain.models.moe.layer import RouterStats
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import hf_rope_parameters, parse_hf_rope
from functrain.models.scan import apply_layers
from functrain.parallel.sharding import constrain_batch

_Config = TypeVar("_Config", bound=HybridConfig)
# The keys of HF's rope_parameters these families keep as fields of their own.
_ROPE_FIELDS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def config_from_hf(cls: type[_Config], hf: dict[str, Any], ignored: tuple[str, ...] = ()) -> _Config:
    """``cls`` from an HF config.json dict (``ignored``: keys transformers does not read for this model type); a
    setting functrain does not implement is a one-line ConfigError naming it."""
    name = cls.model_fields["name"].default
    if hf.get("attention_dropout"):
        raise ConfigError(
            f"config.json: attention_dropout {hf['attention_dropout']} is not supported for {name} (functrain's "
            f"attention has no dropout); set it to 0.0 in config.json"
        )
    hf = {key: value for key, value in hf.items() if key not in ignored}
    rope = dict(hf.pop("rope_parameters", None) or hf.pop("rope_scaling", None) or {})
    own = {key: rope.pop(key) for key in _ROPE_FIELDS if key in rope}
    top_level = hf.pop("partial_rotary_factor", None)  # where older configs write it
    own.setdefault("partial_rotary_factor", top_level or 0.25)  # transformers' default
    if hf.get("layer_types") is None:
        interval = hf.get("full_attention_interval") or FULL_ATTENTION_INTERVAL
        layers = int(hf.get("num_hidden_layers", 0))
        hf["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    try:
        hf, scaling = parse_hf_rope({**hf, "rope_parameters": rope})
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for {name}; fix config.json") from None
    return cls.from_hf_dict({**hf, **own}, **({"rope_scaling": scaling} if scaling else {}))


def config_to_hf(config: HybridConfig, model_type: str, architecture: str, exclude: tuple[str, ...] = ()) -> dict:
    """An HF config.json dict (transformers 5 layout) for ``config``'s family (``exclude``: fields HF lacks)."""
    own = {"linear_chunk_size", "gdn_kernel"}  # functrain's keys of the delta rule
    fields = {"rope_theta", "rope_scaling", *own, *_ROPE_FIELDS, *MOE_RUNTIME_KEYS, *exclude}
    hf = hf_config_dict(config, exclude=fields)
    rope = hf_rope_parameters(config)
    rope.update({key: getattr(config, key) for key in _ROPE_FIELDS if getattr(config, key) is not None})
    hf.update(
        model_type=model_type,
        architectures=[architecture],
        rope_parameters=rope,
        layer_types=[config.layer_type(i) for i in range(config.num_hidden_layers)],
        attention_dropout=0.0,
    )
    return hf


def from_hf_config(hf: dict[str, Any]) -> Qwen3NextConfig:
    """Qwen3NextConfig from an HF config.json dict."""
    return config_from_hf(Qwen3NextConfig, hf)


def to_hf_config(config: Qwen3NextConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3NextForCausalLM."""
    return config_to_hf(config, "qwen3_next", "Qwen3NextForCausalLM")


def feed_forward(config: HybridConfig, dtype: Any, layer: int) -> nn.Module:
    """The layer's MLP: the experts with their gated shared expert on a sparse layer of a mixture of experts
    (:func:`functrain.models.qwen_moe.feed_forward`), else a SwiGLU of ``intermediate_size``."""
    if isinstance(config, MoeOptions):
        return qwen_moe.feed_forward(config, dtype, layer, "mlp")
    return LlamaMLP(config, dtype, name="mlp")  # type: ignore[arg-type]  # Qwen3.5's has intermediate_size


class HybridBlock(nn.Module):
    """One decoder layer: Gated DeltaNet (``linear_attn``) or gated attention (``self_attn``), then the MLP.
    Returns ``x``, with the router's statistics in a mixture of experts."""

    config: HybridConfig
    dtype: Any
    layer: int

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, token_mask=None):
        cfg = self.config
        mixed = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="input_layernorm")(x)
        if cfg.layer_type(self.layer) == "linear_attention":
            mixed = GatedDeltaNet(cfg, self.dtype, name="linear_attn")(mixed, segment_ids)
        else:
            mixed = GatedAttention(cfg, self.dtype, name="self_attn")(mixed, segment_ids, positions)
        x = x + mixed
        normed = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x)
        mlp = feed_forward(cfg, self.dtype, self.layer)
        if not isinstance(cfg, MoeOptions):
            return x + mlp(normed)
        if cfg.moe_layer(self.layer):
            y, stats = mlp(normed, token_mask)
        else:
            y, stats = mlp(normed), RouterStats.zeros(cfg.expert_count())
        return x + y, stats


class HybridForCausalLM(nn.Module):
    """``apply({"params": p}, input_ids[B, T])``: float32 logits [B, T, vocab], or a ModelOutput with the experts'
    statistics (module docstring)."""

    config: HybridConfig
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(
        self, input_ids, deterministic: bool = True, *, segment_ids=None, positions=None, token_mask=None,
        logits_chunk=None,
    ):  # fmt: skip
        """Logits for ``input_ids``; ``deterministic`` is accepted for the task interface (no dropout here); the
        keywords: see the module docstring (``logits_chunk``: the head unapplied, :mod:`functrain.models.head`)."""
        cfg = self.config
        experts = isinstance(cfg, MoeOptions)
        tokens = embed(
            cfg.vocab_size,
            cfg.hidden_size,
            ("vocab", "embed"),
            dtype=self.dtype,
            init_std=cfg.initializer_range,
            name="embed_tokens",
        )
        x = constrain_batch(tokens(input_ids))
        block = remat_block(HybridBlock, cfg.remat, prevent_cse=not cfg.scan_layers)
        out = apply_layers(
            x,
            kinds=cfg.layer_kinds(),
            make_block=lambda i, name: block(cfg, self.dtype, i, name=name),
            prefix="layers_",
            scan=cfg.scan_layers,
            args=(segment_ids, positions, token_mask),
            collect=experts,
        )
        x, stats = out if experts else (out, None)
        x = GemmaRMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        logits = lm_head(self, tokens, x, cfg, cfg.initializer_range, logits_chunk)
        return logits if stats is None else moe_output(logits, stats, balancing(cfg))


def build(config: HybridConfig, dtype: Any = jnp.float32) -> HybridForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its attention
    kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, config.head_dim)
    check_remat(config.remat)
    return HybridForCausalLM(config, dtype=dtype)
