"""The torch twins of functrain's registry models, and what they do not implement.

``backend: torch`` trains the config's registry model through its twin (:mod:`torch_bridge.models`): the same
layers, initialisers and parameter names, found through the family's ``torch_twin``. A twin implements its
``keys``; any other key of the model section set away from its default (``model.remat``,
``model.attention=cudnn``...) is refused in one line rather than silently ignored.
"""

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from functrain.core.targets import import_target
from functrain.errors import ConfigError
from functrain.models import family_named, family_names
from torch_bridge.models import GPT, MLP


@dataclass(frozen=True)
class TorchTwin:
    """A registry model's PyTorch twin, what a family's ``torch_twin`` names
    (:class:`functrain.models.family.Family`): the model-section keys it honours, and how to make it from the
    model section and an example batch (a module whose ``reset_parameters(generator)`` initialises it as the Flax
    model is)."""

    keys: tuple[str, ...]
    make: Callable[[Any, Mapping[str, np.ndarray]], nn.Module]


MLP_TWIN = TorchTwin(
    ("name", "hidden", "num_classes"),
    lambda c, batch: MLP(int(np.shape(batch["x"])[-1]), list(c.hidden), c.num_classes),
)
GPT_TWIN = TorchTwin(
    ("name", "vocab_size", "max_len", "d_model", "n_layers", "n_heads", "d_ff", "dropout"),
    lambda c, batch: GPT(c.vocab_size, c.max_len, c.d_model, c.n_layers, c.n_heads, c.d_ff, c.dropout),
)


def twin_of(model_config: Any) -> TorchTwin:
    """The twin of a registry model section's family; a family without one is a one-line ConfigError."""
    family = family_named(model_config.name)
    if family.torch_twin is None:
        raise ConfigError(
            f"model.name={family.name!r} has no torch twin; use {' or '.join(family_names('torch_twin'))} with "
            f"backend: torch, pass a torch nn.Module with fit(..., model=), or set backend=jax"
        )
    twin = import_target(family.torch_twin, f"family {family.name!r}'s torch_twin")
    if not isinstance(twin, TorchTwin):
        raise ConfigError(
            f"family {family.name!r}'s torch_twin {family.torch_twin!r} is a {type(twin).__name__}, not a "
            f"torch_bridge.twins.TorchTwin; point it at one"
        )
    return twin


def refuse_untwinned(model_config: Any) -> None:
    """One-line ConfigError for a registry model without a twin, or a key its twin does not implement."""
    twin = twin_of(model_config)
    fields = type(model_config).model_fields
    for key, field in fields.items():
        value = getattr(model_config, key)
        if key not in twin.keys and value != field.get_default(call_default_factory=True):
            raise ConfigError(
                f"model.{key}={value} is not implemented by the torch {model_config.name} twin (backend: torch); "
                f"remove model.{key} or set backend=jax"
            )


def twin_model(model_config: Any, example_batch: Mapping[str, np.ndarray], seed: int) -> nn.Module:
    """The twin of a validated registry model section, initialised from ``seed`` as the Flax model is, after
    :func:`refuse_untwinned`."""
    refuse_untwinned(model_config)
    model: Any = twin_of(model_config).make(model_config, example_batch)  # a twin: reset_parameters(generator)
    model.reset_parameters(torch.Generator().manual_seed(int(seed)))
    return model
