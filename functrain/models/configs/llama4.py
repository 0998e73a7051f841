"""``model.name: llama4``: Llama 4's language model (HF ``llama4_text``): chunked local attention with rotary
embeddings and global NoPE layers between them, and experts on every ``interleave_moe_layer_step``-th layer (top-1
by a sigmoid router, plus a shared expert) (:mod:`functrain.models.llama4`)."""

import dataclasses
from typing import Hashable, Literal

import pydantic

from functrain.models.configs.base import DecoderShape
from functrain.models.configs.llama import LlamaConfig
from functrain.models.configs.moe import LocalExperts
from functrain.models.family import Family

Llama4LayerType = Literal["full_attention", "chunked_attention"]


class Llama4TextConfig(LocalExperts, LlamaConfig):
    """Llama 4 (text) hyper-parameters, named as in HF's config.json (the defaults are transformers', Scout's
    shape): ``intermediate_size`` is each expert's and the shared expert's width, ``intermediate_size_mlp`` the dense
    layers'; ``no_rope_layers`` marks 1 a layer with RoPE (chunked by default), 0 a NoPE layer (global)."""

    name: Literal["llama4"] = "llama4"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(202048, gt=0)
    hidden_size: int = pydantic.Field(5120, gt=0)
    intermediate_size: int = pydantic.Field(8192, gt=0)
    intermediate_size_mlp: int = pydantic.Field(16384, gt=0)
    num_hidden_layers: int = pydantic.Field(48, gt=0)
    num_attention_heads: int = pydantic.Field(40, gt=0)
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    max_position_embeddings: int = pydantic.Field(4096 * 32, gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    mlp_bias: Literal[False] = False  # not an HF Llama 4 key: its MLPs have no biases
    num_local_experts: int = pydantic.Field(16, gt=0)
    num_experts_per_tok: int = pydantic.Field(1, gt=0)
    moe_layers: tuple[int, ...] | None = None  # None: every interleave_moe_layer_step-th layer
    interleave_moe_layer_step: int = pydantic.Field(1, gt=0)
    use_qk_norm: bool = True  # an RMS norm without weights on the RoPE layers' queries and keys
    no_rope_layers: tuple[Literal[0, 1], ...] | None = None  # None: every no_rope_layer_interval-th layer NoPE
    no_rope_layer_interval: int = pydantic.Field(4, gt=0)
    attention_chunk_size: int | None = pydantic.Field(8192, gt=0)
    layer_types: tuple[Llama4LayerType, ...] | None = None  # None: the RoPE layers chunked (with a chunk size)
    # The NoPE layers' queries scaled by 1 + attn_scale * log(1 + floor((position + 1) / floor_scale)).
    attn_temperature_tuning: bool = True
    floor_scale: int = pydantic.Field(8192, gt=0)
    attn_scale: float = 0.1

    @pydantic.model_validator(mode="after")
    def _layers_described(self):
        layers = self.num_hidden_layers
        if self.no_rope_layers is not None and len(self.no_rope_layers) != layers:
            raise ValueError(f"no_rope_layers has {len(self.no_rope_layers)} entries for {layers} layers")
        if self.layer_types is not None and len(self.layer_types) != layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {layers} layers")
        outside = [layer for layer in self.moe_layers or () if not 0 <= layer < layers]
        if outside:
            raise ValueError(f"moe_layers names layers {outside} of a model of {layers} layers")
        if "chunked_attention" in self.resolved_layer_types() and self.attention_chunk_size is None:
            raise ValueError("layer_types has chunked_attention layers but attention_chunk_size is unset; set it")
        return self

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` applies the rotary embedding (``no_rope_layers``, or the default interval)."""
        if self.no_rope_layers is None:
            return (layer + 1) % self.no_rope_layer_interval != 0
        return self.no_rope_layers[layer] == 1

    def resolved_layer_types(self) -> tuple[Llama4LayerType, ...]:
        """``layer_types``, or transformers' default: the RoPE layers chunked when there is a chunk size."""
        if self.layer_types is not None:
            return self.layer_types
        chunked = self.attention_chunk_size is not None
        return tuple(
            "chunked_attention" if chunked and self.uses_rope(i) else "full_attention"
            for i in range(self.num_hidden_layers)
        )

    def attention_chunk(self, layer: int) -> int | None:
        """The chunk of positions ``layer`` attends within (None: the whole context)."""
        return self.attention_chunk_size if self.resolved_layer_types()[layer] == "chunked_attention" else None

    def rope_for(self, layer: int) -> "Llama4TextConfig | None":
        """The config's rotary embedding, or None on a NoPE layer."""
        return self if self.uses_rope(layer) else None

    def moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has experts: ``moe_layers``, or every ``interleave_moe_layer_step``-th layer."""
        if self.moe_layers is not None:
            return layer in self.moe_layers
        return (layer + 1) % self.interleave_moe_layer_step == 0

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's chunk, rope and experts: what a scan groups layers by."""
        return [(self.attention_chunk(i), self.uses_rope(i), self.moe_layer(i)) for i in range(self.num_hidden_layers)]

    def decoder_shape(self) -> DecoderShape:
        """Llama's shape with the MLP width a token uses, averaged over the layers (k experts and the shared
        expert on sparse layers, ``intermediate_size_mlp`` on dense ones) and the router's outputs."""
        layers = self.num_hidden_layers
        sparse = sum(self.moe_layer(i) for i in range(layers))
        active = sparse * (self.num_experts_per_tok + 1) * self.intermediate_size
        active += (layers - sparse) * self.intermediate_size_mlp
        return dataclasses.replace(
            LlamaConfig.decoder_shape(self),
            mlp_width=round(active / layers),
            router_width=round(sparse * self.num_local_experts / layers),
        )


FAMILY = Family(
    name="llama4",
    config=Llama4TextConfig,
    code="functrain.models.llama4",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=False,  # chunked attention's segments are not split over the context axis
    pipeline=False,  # not tested
    generation_cache=True,
    hf_model_types=("llama4_text",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA4",
)
