"""Phi-3: Llama without biases, sliding-window attention (``sliding_window``) on every layer and ``longrope``
RoPE scaling. HF fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``; functrain keeps them
separate (as GPT-2's ``c_attn``), so each can be sharded by head, and the conversion table splits them.

The module is Llama's (`functrain.models.llama`); only the config differs.
"""

from typing import Any

from functrain.models import llama
from functrain.models.configs.phi3 import Phi3Config


def from_hf_config(hf: dict[str, Any]) -> Phi3Config:
    """Phi3Config from an HF config.json dict; as in transformers, the top-level
    ``original_max_position_embeddings`` wins over the rope parameters' (older exports call longrope "su")."""
    hf = dict(hf)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope.pop("type", None)
        rope["rope_type"] = "longrope"
    if rope.get("rope_type", rope.get("type")) == "longrope" and "original_max_position_embeddings" in hf:
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    hf.pop("rope_scaling", None)
    hf["rope_parameters"] = rope or None
    return llama.config_from_hf(Phi3Config, hf)


def to_hf_config(config: Phi3Config) -> dict[str, Any]:
    """An HF config.json dict that loads as Phi3ForCausalLM."""
    return llama.config_to_hf(
        config, "phi3", "Phi3ForCausalLM", exclude={"attention_bias", "mlp_bias"}, resid_pdrop=0.0, embd_pdrop=0.0
    )


build = llama.build  # the Flax module is Llama's; the config switches its variations
