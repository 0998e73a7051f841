"""Qwen2 / Qwen2.5: Llama with a bias on the q/k/v projections (none on ``o_proj``) and optional
sliding-window attention on the layers ``layer_types`` marks ``sliding_attention``.

The module is Llama's (`functrain.models.llama`); only the config differs.
"""

from typing import Any

from functrain.models import llama
from functrain.models.configs.qwen2 import Qwen2Config


def sliding_layer_settings(hf: dict[str, Any]) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as transformers derives them for Qwen2/Qwen3: the window only
    with ``use_sliding_window``, applied from layer ``max_window_layers`` on unless ``layer_types`` is given."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    layers = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(layers)
    ]
    if window is None:  # HF attends fully on every layer then, whatever layer_types says
        types = ["full_attention"] * len(types)
    return {"sliding_window": window, "layer_types": tuple(types)}


def hf_sliding_layer_keys(config: Qwen2Config) -> dict[str, Any]:
    """The config.json keys that make transformers derive ``config``'s windows."""
    types = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
    first_sliding = types.index("sliding_attention") if "sliding_attention" in types else len(types)
    return dict(
        use_sliding_window=config.sliding_window is not None,
        sliding_window=config.sliding_window,
        max_window_layers=first_sliding,
        layer_types=types,
    )


def from_hf_config(hf: dict[str, Any]) -> Qwen2Config:
    """Qwen2Config from an HF config.json dict."""
    return llama.config_from_hf(Qwen2Config, {**hf, **sliding_layer_settings(hf)})


def to_hf_config(config: Qwen2Config) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen2ForCausalLM."""
    return llama.config_to_hf(
        config, "qwen2", "Qwen2ForCausalLM", exclude={"attention_bias", "mlp_bias"}, **hf_sliding_layer_keys(config)
    )


build = llama.build  # the Flax module is Llama's; the config switches its variations
