"""Mistral: Llama without biases and with sliding-window attention (``sliding_window``) on every layer.

The module is Llama's (`functrain.models.llama`); only the config differs.
"""

from typing import Any, Literal

import pydantic

from functrain.models import llama


class MistralConfig(llama.LlamaConfig):
    """Mistral hyper-parameters, named as in HF's config.json (``sliding_window`` None: full attention)."""

    name: Literal["mistral"] = "mistral"  # type: ignore[assignment]  # each family's own tag
    attention_bias: Literal[False] = False
    mlp_bias: Literal[False] = False
    sliding_window: int | None = pydantic.Field(None, gt=0)

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on every layer (HF's Mistral ignores ``layer_types``)."""
        return self.sliding_window


def from_hf_config(hf: dict[str, Any]) -> MistralConfig:
    """MistralConfig from an HF config.json dict."""
    return llama.config_from_hf(MistralConfig, hf)


def to_hf_config(config: MistralConfig) -> dict[str, Any]:
    """An HF config.json dict that loads as MistralForCausalLM."""
    return llama.config_to_hf(config, "mistral", "MistralForCausalLM", exclude={"attention_bias", "mlp_bias"})


build = llama.build  # the Flax module is Llama's; the config switches its variations

MODEL_SPEC = dict(config_cls=MistralConfig, build=build, kind="causal_lm")
