"""SmolLM3 (HF ``SmolLM3ForCausalLM``): Llama whose NoPE layers (``no_rope_layers`` 0) attend without a rotary
embedding, with Llama's ``attention_bias``/``mlp_bias`` and sliding windows on the layers ``layer_types`` marks.

The module is Llama's (:mod:`functrain.models.llama`); only the config differs.
"""

from typing import Any

from functrain.models import llama
from functrain.models.configs.hf import NO_DROPOUT, refuse_unimplemented
from functrain.models.configs.smollm3 import SmolLM3Config


def from_hf_config(hf: dict[str, Any]) -> SmolLM3Config:
    """SmolLM3Config from an HF config.json dict (old or v5 rope layout); a setting it does not implement is named."""
    refuse_unimplemented(hf, "smollm3", NO_DROPOUT)
    no_rope, layers = hf.get("no_rope_layers"), hf.get("num_hidden_layers")
    if isinstance(no_rope, list) and isinstance(layers, int) and len(no_rope) > layers:
        hf = {**hf, "no_rope_layers": no_rope[:layers]}  # HF reads the first num_hidden_layers entries
    return llama.config_from_hf(SmolLM3Config, hf)


def to_hf_config(config: SmolLM3Config) -> dict[str, Any]:
    """An HF config.json dict that loads as SmolLM3ForCausalLM (every layer's rope and type written out)."""
    layers = range(config.num_hidden_layers)
    return llama.config_to_hf(
        config,
        "smollm3",
        "SmolLM3ForCausalLM",
        no_rope_layers=[int(config.uses_rope(i)) for i in layers],
        layer_types=list(config.resolved_layer_types()),
    )


build = llama.build  # the Flax module is Llama's; the config switches its variations
