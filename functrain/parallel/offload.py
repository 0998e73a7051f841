"""Optimizer-state offload (ZeRO-Offload style): ``train.offload_optimizer: true``.

The optimizer state lives in pinned host memory between steps (its shardings carry
``memory_kind="pinned_host"``); each step copies it to the device, updates it there and copies the new state
back, so device memory holds it only for the update. Only where device and host memory differ (GPU, TPU):
elsewhere :func:`check_offload` is a one-line ConfigError.
"""

from typing import Any, Callable

import jax

from functrain.core.state import TrainState
from functrain.errors import ConfigError
from functrain.parallel.memory import HOST_MEMORY_KIND, host_offload_available, platform_name


def check_offload() -> None:
    """A ConfigError (one line) when this platform has no separate host memory space to offload to."""
    if not host_offload_available():
        raise ConfigError(
            f"train.offload_optimizer needs a GPU or TPU with a pinned_host memory space and this "
            f"run's devices are {platform_name()}; set train.offload_optimizer=false"
        )


def host_shardings(shardings: Any) -> Any:
    """The same shardings in pinned host memory."""
    return jax.tree.map(lambda sharding: sharding.with_memory_kind(HOST_MEMORY_KIND), shardings)


def offload_opt_state(state_shardings: TrainState) -> TrainState:
    """State shardings with the optimizer state in pinned host memory."""
    return state_shardings.replace(opt_state=host_shardings(state_shardings.opt_state))


def streaming_optimizer(train_step: Callable, device_opt_shardings: Any) -> Callable:
    """``train_step`` for a state whose optimizer state is in host memory: it is brought to the device
    (``device_opt_shardings``) for the update and the new one is written back to host memory."""
    host_opt_shardings = host_shardings(device_opt_shardings)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        state = state.replace(opt_state=jax.device_put(state.opt_state, device_opt_shardings))
        new_state, metrics = train_step(state, batch)
        return new_state.replace(opt_state=jax.device_put(new_state.opt_state, host_opt_shardings)), metrics

    return step
