"""A multi-layer perceptron classifier (the digits job)."""

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from functrain.models.configs.mlp import MLPConfig
from functrain.parallel.sharding import constrain_batch


def hidden_axis_names(num_hidden: int) -> list[str]:
    """Logical names of the feature axes: input ``embed``, then hidden widths alternating ``mlp``/``embed``.

    Alternating keeps each kernel's two axes on different mesh axes (FSDP on one, tensor on the other).
    """
    return ["embed"] + ["mlp" if i % 2 == 0 else "embed" for i in range(num_hidden)]


class MLP(nn.Module):
    """Dense + ReLU layers, then a linear classifier head. Returns float32 logits."""

    hidden: tuple[int, ...]
    num_classes: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jnp.ndarray, deterministic: bool = True) -> jnp.ndarray:
        names = hidden_axis_names(len(self.hidden))
        x = x.astype(self.dtype)
        for i, width in enumerate(self.hidden):
            x = nn.Dense(
                width,
                dtype=self.dtype,
                name=f"dense_{i}",
                kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (names[i], names[i + 1])),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (names[i + 1],)),
            )(x)
            x = constrain_batch(nn.relu(x))  # keep the batch split; gather FSDP weights instead
        logits = nn.Dense(
            self.num_classes,
            dtype=self.dtype,
            name="head",
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), (names[-1], "classes")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("classes",)),
        )(x)
        return logits.astype(jnp.float32)


def build(config: MLPConfig, dtype: Any = jnp.float32) -> MLP:
    """The MLP module for ``config``, computing in ``dtype``."""
    return MLP(hidden=tuple(config.hidden), num_classes=config.num_classes, dtype=dtype)
