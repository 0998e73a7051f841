"""The devices a program is built and compiled for, which need not be the process's own.

``functrain plan --topology v5p:2x2x2`` builds and compiles a run for TPU chips from a process whose devices
are CPUs, so a choice that depends on the hardware (``model.attention=auto``: splash on a TPU, cuDNN on a GPU)
must ask what the program is compiled for, not ``jax.devices()``. In order:

1. the mesh being traced under (``jax.set_mesh``: a train call is compiled under its mesh, whose devices are a
   TPU topology's when planning);
2. the devices named by :func:`compiling_for` (the planner wraps the build in it: models are built, and their
   init traced, before a mesh is in context);
3. the process's default devices.
"""

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import jax

_COMPILING_FOR: ContextVar[Any] = ContextVar("compiling_for", default=None)


@contextlib.contextmanager
def compiling_for(devices: Sequence[Any] | None) -> Iterator[None]:
    """Within the block, :func:`target_device` is ``devices[0]`` (no change when ``devices`` is None)."""
    token = _COMPILING_FOR.set(devices[0] if devices else _COMPILING_FOR.get())
    try:
        yield
    finally:
        _COMPILING_FOR.reset(token)


def target_device() -> Any:
    """A device (or ``jax.sharding.AbstractDevice``) of the kind the code being built runs on: it has
    ``.platform`` (``cpu``, ``gpu``, ``tpu``) and ``.device_kind``; see the module for the order."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and getattr(mesh, "abstract_device", None) is not None:
        return mesh.abstract_device
    return _COMPILING_FOR.get() or jax.devices()[0]


def target_platform() -> str:
    """``cpu``, ``gpu`` (``cuda``/``rocm`` are reported as such by JAX) or ``tpu``: :func:`target_device`'s."""
    return target_device().platform


def target_name() -> str:
    """The target's platform and kind, for error messages (``cpu``, ``tpu (TPU v5)``)."""
    device = target_device()
    return device.platform if device.platform == "cpu" else f"{device.platform} ({device.device_kind})"
