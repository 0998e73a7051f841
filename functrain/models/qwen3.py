"""Qwen3 (dense): Qwen2's sliding-window layers, no fixed q/k/v bias (``attention_bias`` covers all four
projections), an explicit ``head_dim`` and RMSNorm over each query and key head (``q_norm``/``k_norm``)."""

from typing import Any, Literal

import pydantic

from functrain.models import llama, qwen2


class Qwen3Config(qwen2.Qwen2Config):
    """Qwen3 hyper-parameters, named as in HF's config.json."""

    name: Literal["qwen3"] = "qwen3"  # type: ignore[assignment]  # each family's own tag
    attention_bias: bool = False  # type: ignore[assignment]  # an HF key again (Qwen2 pins it)
    head_dim: int | None = pydantic.Field(128, gt=0)  # HF's default, not hidden_size // heads

    # ``attention_bias`` covers all four projections, as on Llama (Qwen2 fixes q/k/v on and o off).
    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v projections carry a bias."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether the output projection carries a bias."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each query and key head."""
        return True


def from_hf_config(hf: dict[str, Any]) -> Qwen3Config:
    """Qwen3Config from an HF config.json dict."""
    return llama.config_from_hf(Qwen3Config, {**hf, **qwen2.sliding_layer_settings(hf)})


def to_hf_config(config: Qwen3Config) -> dict[str, Any]:
    """An HF config.json dict that loads as Qwen3ForCausalLM."""
    return llama.config_to_hf(config, "qwen3", "Qwen3ForCausalLM", exclude={"mlp_bias"},
                              **qwen2.hf_sliding_layer_keys(config))


build = llama.build  # the Flax module is Llama's; the config switches its variations

MODEL_SPEC = dict(config_cls=Qwen3Config, build=build, kind="causal_lm")
