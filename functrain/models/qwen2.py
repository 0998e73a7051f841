"""Qwen2 / Qwen2.5: Llama with a bias on the q/k/v projections (none on ``o_proj``) and optional
sliding-window attention on the layers ``layer_types`` marks ``sliding_attention``.

The module is Llama's (`functrain.models.llama`); only the config differs.
"""

from typing import Any, Literal

import pydantic

from functrain.models import llama

LayerType = Literal["full_attention", "sliding_attention"]


class Qwen2Config(llama.LlamaConfig):
    """Qwen2 hyper-parameters, named as in HF's config.json (``sliding_window`` is None unless used)."""

    name: Literal["qwen2"] = "qwen2"  # type: ignore[assignment]  # each family's own tag
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


def sliding_layer_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers derives them for Qwen2/Qwen3: the window only
    with ``use_sliding_window``, applied from layer ``max_window_layers`` on unless ``layer_types`` is given."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    layers = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types") or ["sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28)
                                      else "full_attention" for i in range(layers)]
    if window is None:  # HF attends fully on every layer then, whatever layer_types says
        types = ["full_attention"] * len(types)
    return {"sliding_window": window, "layer_types": tuple(types)}


def hf_sliding_layer_keys(config: Qwen2Config) -> dict[str, Any]:
    """The config.json keys that make transformers derive ``config``'s windows."""
    types = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
    first_sliding = types.index("sliding_attention") if "sliding_attention" in types else len(types)
    return dict(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                max_window_layers=first_sliding, layer_types=types)


def from_hf_config(hf: dict[str, Any]) -> Qwen2Config:
    """Qwen2Config from an HF config.json dict."""
    return llama.config_from_hf(Qwen2Config, {**hf, **sliding_layer_settings(hf)})


def to_hf_config(config: Qwen2Config) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen2ForCausalLM."""
    return llama.config_to_hf(config, "qwen2", "Qwen2ForCausalLM", exclude={"attention_bias", "mlp_bias"},
                              **hf_sliding_layer_keys(config))


build = llama.build  # the Flax module is Llama's; the config switches its variations

MODEL_SPEC = dict(config_cls=Qwen2Config, build=build, kind="causal_lm")
