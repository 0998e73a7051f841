"""The torch twins of functrain's registry models, and what they do not implement.

``backend: torch`` trains the config's registry model through its twin (:mod:`torch_bridge.models`): the same
layers, initialisers and parameter names. A twin implements the keys in :data:`TWIN_KEYS`; any other key of
the model section set away from its default (``model.remat``, ``model.attention=cudnn``...) is refused in
one line rather than silently ignored.
"""

from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from functrain.errors import ConfigError
from torch_bridge.models import GPT, MLP

# Registry model -> the model-section keys its twin honours.
TWIN_KEYS: dict[str, tuple[str, ...]] = {
    "mlp": ("name", "hidden", "num_classes"),
    "gpt": ("name", "vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff", "dropout"),
}


def refuse_untwinned(model_config: Any) -> None:
    """One-line ConfigError for a registry model without a twin, or a key its twin does not implement."""
    name = model_config.name
    if name not in TWIN_KEYS:
        raise ConfigError(
            f"model.name={name!r} has no torch twin; use {' or '.join(TWIN_KEYS)} with backend: torch, "
            f"pass a torch nn.Module with fit(..., model=), or set backend=jax"
        )
    fields = type(model_config).model_fields
    for key, field in fields.items():
        value = getattr(model_config, key)
        if key not in TWIN_KEYS[name] and value != field.get_default(call_default_factory=True):
            raise ConfigError(
                f"model.{key}={value} is not implemented by the torch {name} twin (backend: torch); "
                f"remove model.{key} or set backend=jax"
            )


def twin_model(model_config: Any, example_batch: Mapping[str, np.ndarray], seed: int) -> nn.Module:
    """The twin of a validated registry model section, initialised from ``seed`` as the Flax model is, after
    :func:`refuse_untwinned`."""
    refuse_untwinned(model_config)
    c = model_config
    model: MLP | GPT
    if c.name == "mlp":
        model = MLP(int(np.shape(example_batch["x"])[-1]), list(c.hidden), c.num_classes)
    else:
        model = GPT(c.vocab_size, c.max_len, c.d_model, c.n_layers, c.n_heads, c.d_ff, c.dropout)
    model.reset_parameters(torch.Generator().manual_seed(int(seed)))
    return model
