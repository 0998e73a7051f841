"""``model.name: olmo3``: OLMo 3, Llama's module with OLMo's norm placement (each sublayer's output normalised
before the residual add), RMSNorm over all query and all key features, and sliding and full layers each with its
own rotary embedding (:mod:`functrain.models.olmo3`)."""

from typing import Literal

import pydantic

from functrain.models.configs.hf import LayerType
from functrain.models.configs.llama import LlamaConfig
from functrain.models.configs.rope import RopeScaling, RopeSettings
from functrain.models.family import Family


class Olmo3Config(LlamaConfig):
    """OLMo 3 hyper-parameters, named as in HF's config.json (the defaults are transformers'); the full-attention
    layers' rope is ``rope_theta``/``rope_scaling``, the sliding layers' ``sliding_rope_theta``/
    ``sliding_rope_scaling`` (HF nests both in ``rope_parameters`` by layer type)."""

    name: Literal["olmo3"] = "olmo3"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(50304, gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    sliding_rope_theta: float = 500000.0
    sliding_rope_scaling: RopeScaling | None = None
    mlp_bias: Literal[False] = False  # not an HF OLMo key: its MLP has no biases
    sliding_window: int | None = pydantic.Field(4096, gt=0)
    # None: transformers' default, three sliding layers then a full one.
    layer_types: tuple[LayerType, ...] | None = None

    @pydantic.model_validator(mode="after")
    def _layer_types_fit(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.sliding_window is None and "sliding_attention" in self.resolved_layer_types():
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    def resolved_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or transformers' default (every fourth layer full, the others sliding)."""
        if self.layer_types is not None:
            return self.layer_types
        return tuple(
            "full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(self.num_hidden_layers)
        )

    @property
    def qk_norm(self) -> bool:
        """OLMo normalises the queries and the keys."""
        return True

    @property
    def qk_norm_across_heads(self) -> bool:
        """Over all heads' features at once (``q_norm`` is ``num_attention_heads * head_dim`` wide)."""
        return True

    @property
    def post_norms(self) -> bool:
        """OLMo normalises each sublayer's output (``post_attention_layernorm``, ``post_feedforward_layernorm``)."""
        return True

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on the ``sliding_attention`` layers, None (full) on the others."""
        return self.sliding_window if self.resolved_layer_types()[layer] == "sliding_attention" else None

    def sliding_rope(self) -> RopeSettings:
        """The sliding layers' rotary embedding."""
        return RopeSettings(
            self.sliding_rope_theta, self.sliding_rope_scaling, self.attn_head_dim, self.max_position_embeddings
        )

    def rope_for(self, layer: int) -> "Olmo3Config | RopeSettings":
        """The full-attention rope (the config's own) or, on a sliding layer, the sliding one."""
        return self if self.attention_window(layer) is None else self.sliding_rope()


FAMILY = Family(
    name="olmo3",
    config=Olmo3Config,
    code="functrain.models.olmo3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("olmo3",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
