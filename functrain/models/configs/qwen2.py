"""``model.name: qwen2``: Llama with q/k/v biases and sliding windows on the layers ``layer_types`` marks
(:mod:`functrain.models.qwen2`)."""

from typing import Literal

import pydantic

from functrain.models.configs.hf import LayerType
from functrain.models.configs.llama import LlamaConfig
from functrain.models.family import Family


class Qwen2Config(LlamaConfig):
    """Qwen2 hyper-parameters, named as in HF's config.json (``sliding_window`` is None unless used)."""

    name: Literal["qwen2"] = "qwen2"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    attention_bias: Literal[False] = False  # not an HF Qwen2 key: q/k/v always have a bias, o_proj never
    mlp_bias: Literal[False] = False
    sliding_window: int | None = pydantic.Field(None, gt=0)
    layer_types: tuple[LayerType, ...] | None = None

    @pydantic.model_validator(mode="after")
    def _layer_types_fit(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.sliding_window is None and "sliding_attention" in (self.layer_types or ()):
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 always has q/k/v biases."""
        return True

    @property
    def o_bias(self) -> bool:
        """Qwen2's o_proj has no bias."""
        return False

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on the layers marked ``sliding_attention``, None (full) on the others."""
        if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window


FAMILY = Family(
    name="qwen2",
    config=Qwen2Config,
    code="functrain.models.qwen2",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("qwen2",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
