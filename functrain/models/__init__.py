"""Model registry: ``model.name`` in a config -> the model's config schema, builder and task kind.

Each model module defines ``MODEL_SPEC = dict(config_cls=..., build=config -> flax module,
kind="classifier" | "causal_lm")``. Modules are imported on first use, so a config naming one model
never imports the others.
"""

import importlib
from typing import Any

import pydantic

MODEL_MODULES = {
    "mlp": "functrain.models.mlp",
    "gpt": "functrain.models.gpt",
    "gemma2": "functrain.models.gemma2",
    "gemma3_text": "functrain.models.gemma3",
    "gpt2": "functrain.models.gpt2",
    "llama": "functrain.models.llama",
    "mistral": "functrain.models.mistral",
    "phi3": "functrain.models.phi3",
    "qwen2": "functrain.models.qwen2",
    "qwen3": "functrain.models.qwen3",
}


def model_spec(name: str) -> dict[str, Any]:
    """The registered spec of model ``name``; an unknown name is a ValueError listing the known ones."""
    if name not in MODEL_MODULES:
        raise ValueError(f"unknown model.name {name!r}; choose one of {', '.join(sorted(MODEL_MODULES))}")
    return importlib.import_module(MODEL_MODULES[name]).MODEL_SPEC


def model_config_class(name: str) -> type[pydantic.BaseModel]:
    """The pydantic schema of model ``name``'s config section."""
    return model_spec(name)["config_cls"]


def build_model(model_config: Any, dtype: Any = None) -> Any:
    """The Flax module for a validated model config, computing in ``dtype`` (float32 when None)."""
    build = model_spec(model_config.name)["build"]
    return build(model_config) if dtype is None else build(model_config, dtype=dtype)
