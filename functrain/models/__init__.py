"""Model registry: ``model.name`` in a config -> the family's config class, its builder and task kind.

Each family registers its config class (pydantic only, :mod:`functrain.models.configs`) with its name here,
so the run config's ``model`` section is a union of them that validates without model code. Each model
module defines ``MODEL_SPEC = dict(config_cls=..., build=config -> flax module, kind="classifier" |
"causal_lm")`` and is imported on first use, so a config naming one model never imports the others.
"""

import importlib
from typing import Any

from functrain.models.configs.base import FamilyConfig
from functrain.models.configs.deepseek_v3 import DeepseekV3Config
from functrain.models.configs.gemma2 import Gemma2Config
from functrain.models.configs.gemma3 import Gemma3TextConfig
from functrain.models.configs.gpt import GPTConfig
from functrain.models.configs.gpt2 import GPT2Config
from functrain.models.configs.gpt_oss import GptOssConfig
from functrain.models.configs.llama import LlamaConfig
from functrain.models.configs.mistral import MistralConfig
from functrain.models.configs.mixtral import MixtralConfig
from functrain.models.configs.mlp import MLPConfig
from functrain.models.configs.phi3 import Phi3Config
from functrain.models.configs.qwen2 import Qwen2Config
from functrain.models.configs.qwen3 import Qwen3Config
from functrain.models.configs.qwen_moe import Qwen2MoeConfig, Qwen3MoeConfig

# name -> (its config class, the module of its code).
MODEL_FAMILIES: dict[str, tuple[type[FamilyConfig], str]] = {
    "mlp": (MLPConfig, "functrain.models.mlp"),
    "gpt": (GPTConfig, "functrain.models.gpt"),
    "gemma2": (Gemma2Config, "functrain.models.gemma2"),
    "gemma3_text": (Gemma3TextConfig, "functrain.models.gemma3"),
    "gpt2": (GPT2Config, "functrain.models.gpt2"),
    "gpt_oss": (GptOssConfig, "functrain.models.gpt_oss"),
    "llama": (LlamaConfig, "functrain.models.llama"),
    "mistral": (MistralConfig, "functrain.models.mistral"),
    "mixtral": (MixtralConfig, "functrain.models.mixtral"),
    "phi3": (Phi3Config, "functrain.models.phi3"),
    "qwen2": (Qwen2Config, "functrain.models.qwen2"),
    "qwen3": (Qwen3Config, "functrain.models.qwen3"),
    "qwen2_moe": (Qwen2MoeConfig, "functrain.models.qwen2_moe"),
    "qwen3_moe": (Qwen3MoeConfig, "functrain.models.qwen3_moe"),
    "deepseek_v3": (DeepseekV3Config, "functrain.models.deepseek_v3"),
}


def _known(name: str) -> str:
    if name not in MODEL_FAMILIES:
        raise ValueError(f"unknown model.name {name!r}; choose one of {', '.join(sorted(MODEL_FAMILIES))}")
    return name


def model_spec(name: str) -> dict[str, Any]:
    """The registered spec of model ``name`` (imports its code); an unknown name is a ValueError listing the
    known ones."""
    return importlib.import_module(MODEL_FAMILIES[_known(name)][1]).MODEL_SPEC


def model_config_class(name: str) -> type[FamilyConfig]:
    """The pydantic schema of model ``name``'s config section (no model code imported)."""
    return MODEL_FAMILIES[_known(name)][0]


def build_model(model_config: FamilyConfig, dtype: Any = None) -> Any:
    """The Flax module for a validated model config, computing in ``dtype`` (float32 when None)."""
    build = model_spec(model_config.name)["build"]
    return build(model_config) if dtype is None else build(model_config, dtype=dtype)


def is_language_model(name: str) -> bool:
    """Whether registered model ``name`` is a causal language model (what decoding and scoring callbacks need)."""
    return model_spec(name)["kind"] == "causal_lm"
