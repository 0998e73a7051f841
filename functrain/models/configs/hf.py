"""The base of the configs whose fields are named like the keys of an HF ``config.json``."""

from typing import Any, Literal

import pydantic

from functrain.errors import ConfigError
from functrain.models.configs.lora import LoraConfig
from functrain.models.options import RUNTIME_KEYS, RuntimeOptions

# HF's ``layer_types`` entries (Qwen2, Gemma): a layer attends within a sliding window or to the whole context.
LayerType = Literal["full_attention", "sliding_attention"]

# HF activation names (transformers.activations.ACT2FN) that these models support -> the function each names
# (computed by functrain.models.hf_common.activation).
ACTIVATIONS: dict[str, str] = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu_exact",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def check_activation(name: str) -> str:
    """``name`` if it is a supported HF activation; a ValueError naming the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; use one of {', '.join(sorted(ACTIVATIONS))}")
    return name


# config.json settings transformers reads that functrain's models do not implement: the one value they compute as
# transformers does, and why (checked by the families that list them in their from_hf_config).
NO_DROPOUT = {"attention_dropout": (0.0, "functrain's model has no attention dropout")}


def refuse_unimplemented(hf: dict[str, Any], family: str, settings: dict[str, tuple[Any, str]]) -> None:
    """A one-line ConfigError naming the first key of ``settings`` whose value in the config.json dict ``hf`` asks
    for something ``family``'s model does not compute (``settings``: key -> (the value it computes, why))."""
    for key, (computed, why) in settings.items():
        if hf.get(key, computed) not in (computed, None):
            raise ConfigError(
                f"config.json: {key} {hf[key]!r} is not supported for {family} ({why}); set {key} to {computed!r} in "
                f"config.json"
            )


class HFModelConfig(RuntimeOptions):
    """Base for model configs whose fields are named like the keys of an HF ``config.json`` (plus the
    runtime options ``attention``, ``remat`` and ``scan_layers``, which an HF config never sets)."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    # Special tokens are not used by the model but travel with it, so generation works after export.
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # Fine-tuning with low-rank adapters (functrain.models.lora); not part of the HF config.
    lora: LoraConfig | None = None

    def lora_settings(self) -> LoraConfig | None:
        """``model.lora``."""
        return self.lora

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], **overrides: Any):
        """Build from an HF config dict, keeping only the keys this config knows (HF adds many more)."""
        known = {
            k: v
            for k, v in hf.items()
            if k in cls.model_fields and k != "name" and k not in RUNTIME_KEYS and v is not None
        }
        known.update(overrides)
        try:
            return cls(**known)
        except pydantic.ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            where = f"{where}: " if where else ""
            raise ConfigError(f"config.json: {where}{message}; fix config.json") from None
