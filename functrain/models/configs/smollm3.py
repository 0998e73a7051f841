"""``model.name: smollm3``: Llama whose layers marked 0 in ``no_rope_layers`` have no rotary embedding (NoPE), with
optional sliding windows on the layers ``layer_types`` marks (:mod:`functrain.models.smollm3`)."""

from typing import Hashable, Literal

import pydantic

from functrain.models.configs.hf import LayerType
from functrain.models.configs.llama import LlamaConfig
from functrain.models.family import Family


class SmolLM3Config(LlamaConfig):
    """SmolLM3 hyper-parameters, named as in HF's config.json (the defaults are SmolLM3-3B's)."""

    name: Literal["smollm3"] = "smollm3"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(128256, gt=0)
    hidden_size: int = pydantic.Field(2048, gt=0)
    intermediate_size: int = pydantic.Field(11008, gt=0)
    num_hidden_layers: int = pydantic.Field(36, gt=0)
    num_attention_heads: int = pydantic.Field(16, gt=0)
    num_key_value_heads: int | None = 4
    max_position_embeddings: int = pydantic.Field(32768, gt=0)
    rope_theta: float = 2000000.0
    tie_word_embeddings: bool = True
    # One entry a layer (HF allows more): 1 rotates, 0 is a NoPE layer; None: every no_rope_layer_interval-th is NoPE.
    no_rope_layers: tuple[Literal[0, 1], ...] | None = None
    no_rope_layer_interval: int = pydantic.Field(4, gt=0)
    use_sliding_window: bool = False
    sliding_window: int | None = pydantic.Field(None, gt=0)
    # None: transformers' default, the NoPE layers sliding when use_sliding_window and sliding_window are set.
    layer_types: tuple[LayerType, ...] | None = None

    @pydantic.model_validator(mode="after")
    def _layers_described(self):
        layers = self.num_hidden_layers
        if self.no_rope_layers is not None and len(self.no_rope_layers) < layers:
            raise ValueError(f"no_rope_layers has {len(self.no_rope_layers)} entries for {layers} layers")
        if self.layer_types is not None and len(self.layer_types) != layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {layers} layers")
        sliding = "sliding_attention" in self.resolved_layer_types()
        if sliding and not (self.use_sliding_window and self.sliding_window is not None):
            # transformers' kernels disagree then: its masks slide by sliding_window, flash attention does not.
            raise ValueError(
                "layer_types has sliding_attention layers but use_sliding_window is false or sliding_window unset; "
                "set both, or mark those layers full_attention"
            )
        return self

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` applies the rotary embedding (``no_rope_layers``, or the default interval)."""
        if self.no_rope_layers is None:
            return (layer + 1) % self.no_rope_layer_interval != 0
        return self.no_rope_layers[layer] == 1

    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or what transformers derives without it."""
        if self.layer_types is not None:
            return self.layer_types
        windowed = self.use_sliding_window and self.sliding_window is not None
        return tuple(
            "sliding_attention" if windowed and not self.uses_rope(i) else "full_attention"
            for i in range(self.num_hidden_layers)
        )

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on the ``sliding_attention`` layers, None (full) on the others."""
        return self.sliding_window if self.resolved_layer_types()[layer] == "sliding_attention" else None

    def rope_for(self, layer: int) -> "SmolLM3Config | None":
        """The config's rotary embedding, or None on a NoPE layer."""
        return self if self.uses_rope(layer) else None

    def layer_kinds(self) -> list[Hashable]:
        """Each layer's window and whether it rotates: what a scan groups layers by."""
        return [(self.attention_window(i), self.uses_rope(i)) for i in range(self.num_hidden_layers)]


FAMILY = Family(
    name="smollm3",
    config=SmolLM3Config,
    code="functrain.models.smollm3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("smollm3",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
