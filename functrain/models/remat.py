"""Rematerialisation of transformer blocks: ``model.remat`` picks what the backward pass recomputes.

- ``none``: every activation is kept (fastest, most memory);
- ``full``: only each block's input is kept, the block is recomputed in the backward pass;
- ``dots_saveable``: matmul outputs are kept, the cheap element-wise work between them is recomputed;
- ``offload``: matmul outputs without batch dimensions go to pinned host memory instead of staying on the
  device (GPU/TPU only; a one-line ConfigError elsewhere).

The gradients are those of ``none``; only memory and time change.
"""

from typing import Any

import flax.linen as nn
import jax

from functrain.errors import ConfigError
from functrain.models.options import RematPolicy
from functrain.parallel.memory import HOST_MEMORY_KIND, host_offload_available, platform_name


def _policy(name: RematPolicy) -> Any:
    policies = jax.checkpoint_policies
    if name == "full":
        return None  # jax.checkpoint's default: save nothing but the inputs
    if name == "dots_saveable":
        return policies.dots_saveable
    return policies.offload_dot_with_no_batch_dims("device", HOST_MEMORY_KIND)


def check_remat(name: RematPolicy) -> None:
    """A ConfigError (one line) when ``model.remat=name`` cannot run on this platform."""
    if name == "offload" and not host_offload_available():
        raise ConfigError(
            f"model.remat=offload needs a GPU or TPU with a pinned_host memory space and this run's "
            f"devices are {platform_name()}; set model.remat=full or model.remat=dots_saveable"
        )


def remat_block(
    block: type[nn.Module], name: RematPolicy, static_argnums: tuple[int, ...] = (), prevent_cse: bool = True
) -> type[nn.Module]:
    """``block`` wrapped in ``nn.remat`` with the policy ``name`` (``block`` itself for ``none``).

    ``static_argnums`` count ``self`` as 0, as ``nn.remat`` does: Python values such as ``deterministic``.
    ``prevent_cse=False`` inside a scan, where XLA cannot merge the recomputation with the forward pass anyway
    and the barriers would only slow it (jax.checkpoint's advice).
    Parameter names are those of the unwrapped block, so checkpoints do not depend on the policy.
    """
    if name == "none":
        return block
    check_remat(name)
    return nn.remat(block, policy=_policy(name), static_argnums=static_argnums, prevent_cse=prevent_cse)
