"""Which JAX platforms a process starts, decided before JAX is imported.

With the ``tpu`` extra installed (libtpu, for ``functrain plan --topology``), JAX loads libtpu in every process
that imports it: on a machine without a TPU that prints a burst of libtpu warnings on stderr and costs a few
tenths of a second at start. Where no TPU is attached (no ``/dev/accel*`` or ``/dev/vfio`` device nodes: a
directory listing, no library loaded), :func:`choose_platforms` names the platforms JAX should start instead,
so every command prints only its own lines. A ``JAX_PLATFORMS`` the user set always wins. Planning for a TPU
topology still works: it compiles through libtpu without starting the TPU backend.
"""

from __future__ import annotations

import glob
import importlib.util
import os

TPU_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")
OTHER_ACCELERATOR_NODES = ("/dev/kfd",)  # ROCm: JAX's own choice finds it
NVIDIA_DEVICE_NODES = ("/dev/nvidia[0-9]*",)
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def _present(patterns: tuple[str, ...]) -> bool:
    return any(glob.glob(pattern) for pattern in patterns)


def platforms_without_tpu() -> str | None:
    """The ``JAX_PLATFORMS`` value for this machine, or None to leave JAX's own choice (a TPU, or an accelerator
    whose platform name is not checked here, is attached)."""
    if _present(TPU_DEVICE_NODES + OTHER_ACCELERATOR_NODES):
        return None
    # JAX skips a listed cuda that has no visible GPU, but fails on one whose plugin is not installed.
    if _present(NVIDIA_DEVICE_NODES) and any(importlib.util.find_spec(name) for name in CUDA_PLUGINS):
        return "cuda,cpu"
    return "cpu"


def choose_platforms() -> None:
    """Set ``JAX_PLATFORMS`` for a machine without a TPU, unless the user set it (call before importing jax)."""
    if "JAX_PLATFORMS" in os.environ:
        return
    platforms = platforms_without_tpu()
    if platforms:
        os.environ["JAX_PLATFORMS"] = platforms
