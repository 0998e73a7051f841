"""Whether a run's state fits in the machine, answered from shapes before any of it is allocated.

A state larger than the memory it is created in does not fail quickly: the runtime waits for memory that never
comes, or the host swaps (a 160 GB MLP on a 23 GiB host printed nothing for ten minutes and ignored Ctrl-C).
The state's size per device is known from ``jax.eval_shape`` and the shardings alone, as ``functrain plan``
reads it, so the builder compares it with what each device and the host have free and refuses in one line.

Only the state is counted (parameters, optimizer state, model state): gradients and activations come on top,
so a state that passes may still not fit a step (``functrain plan`` compiles the step and says), but one that
fails certainly does not. Device memory is ``memory_stats()``'s where the platform reports it (GPU, TPU); a
CPU's devices are the host's RAM, all of them together.
"""

from __future__ import annotations

from typing import Any

import jax
import psutil
from jax.sharding import Mesh

from functrain.errors import ConfigError
from functrain.parallel.memory import HOST_MEMORY_KIND
from functrain.parallel.sharding import human_bytes, state_bytes_per_device


def host_memory() -> tuple[int, int]:
    """``(available, total)`` bytes of this host's RAM (``/proc/meminfo``'s MemAvailable and MemTotal)."""
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def device_memory(device: Any) -> tuple[int, int] | None:
    """``(free, limit)`` bytes of one accelerator's memory as its allocator reports them; None where the platform
    reports none (CPU)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    limit = int(stats["bytes_limit"])
    return limit - int(stats.get("bytes_in_use", 0)), limit


def _split_by_place(abstract: Any, shardings: Any) -> tuple[int, int]:
    """``(device bytes, pinned-host bytes)`` per device of a tree: leaves offloaded to ``pinned_host``
    (``train.offload_optimizer``) live in host memory."""
    device = host = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        size = state_bytes_per_device([leaf], [sharding])[0]
        if getattr(sharding, "memory_kind", None) == HOST_MEMORY_KIND:
            host += size
        else:
            device += size
    return device, host


def check_state_fits(abstract_state: Any, shardings: Any, mesh: Mesh) -> None:
    """A ConfigError (one line: the sizes and the fixes) when the train state alone is larger than the free memory
    of this process's devices, or of its host (CPU devices, offloaded optimizer state)."""
    local = [device for device in mesh.devices.flat if device.process_index == jax.process_index()]
    per_device, per_device_on_host = _split_by_place(abstract_state, shardings)
    params = state_bytes_per_device(abstract_state.params, shardings.params)[0]
    optimizer = state_bytes_per_device(abstract_state.opt_state, shardings.opt_state)[0]
    parts = f"params {human_bytes(params)}, optimizer state {human_bytes(optimizer)}"
    devices = len(mesh.devices.flat)
    fsdp = mesh.shape.get("fsdp", 1)
    shard = (
        f"shard parameters and optimizer state with mesh.fsdp over more devices (this run has {devices})"
        if fsdp >= devices
        else f"raise mesh.fsdp (now {fsdp}; up to {devices}) to shard parameters and optimizer state"
    )
    fixes = (
        f"{shard}, or choose a smaller model; `functrain plan` with the same config shows per-device memory "
        f"without allocating it"
    )
    device = local[0]
    on_device = device_memory(device)
    if on_device is not None and per_device > on_device[0]:
        free, limit = on_device
        raise ConfigError(
            f"the training state needs {human_bytes(per_device)} per device ({parts}) but each "
            f"{device.platform} ({device.device_kind}) has {human_bytes(free)} free of {human_bytes(limit)}; "
            f"{fixes}"
        )
    if on_device is None:  # CPU devices: the host's RAM holds every local device's share
        on_host, what = per_device * len(local), f"{len(local)} cpu device(s) x {human_bytes(per_device)}: {parts}"
    else:
        on_host, what = per_device_on_host * len(local), f"optimizer state offloaded from {len(local)} device(s)"
    available, total = host_memory()
    if on_host > available:
        raise ConfigError(
            f"the training state needs {human_bytes(on_host)} of host memory ({what}) but the host has "
            f"{human_bytes(available)} available of {human_bytes(total)}; {fixes}"
        )
