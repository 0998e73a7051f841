"""The tiny MLP's code: functrain's own MLP module with one hidden layer."""

from typing import Any

import jax.numpy as jnp

from functrain.models.mlp import MLP
from functrain_plugin_example.family import TinyMLPConfig


def build(config: TinyMLPConfig, dtype: Any = jnp.float32) -> MLP:
    """The Flax module for ``config``, computing in ``dtype``."""
    return MLP(hidden=(config.width,), num_classes=config.num_classes, dtype=dtype)
