"""Which JAX platforms a process starts, decided before JAX is imported.

With the ``tpu`` extra installed (libtpu, for ``functrain plan --topology``), JAX loads libtpu in every process
that imports it: on a machine without a TPU that prints a burst of libtpu warnings on stderr and costs a few
tenths of a second at start. Where no TPU is attached (no ``/dev/accel*`` or ``/dev/vfio`` device nodes: a
directory listing, no library loaded), :func:`choose_platforms` names the platforms JAX should start instead,
so every command prints only its own lines. A ``JAX_PLATFORMS`` the user set always wins. Planning for a TPU
topology still works: it compiles through libtpu without starting the TPU backend, and
:func:`describe_host_to_libtpu` answers the questions libtpu would otherwise ask a metadata server that is not
there (five lines of warnings that read as a failure).
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
import sys

TPU_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")
OTHER_ACCELERATOR_NODES = ("/dev/kfd",)  # ROCm: JAX's own choice finds it
NVIDIA_DEVICE_NODES = ("/dev/nvidia[0-9]*",)
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")
# A topology's generation -> libtpu's accelerator-type prefix and TensorCores per chip (the type counts cores): the
# generations libtpu's topology names take (``v5`` is v5p's other name).
ACCELERATOR_TYPES = {
    "v2": ("v2", 2),
    "v3": ("v3", 2),
    "v4": ("v4", 2),
    "v5": ("v5p", 2),
    "v5p": ("v5p", 2),
    "v5e": ("v5litepod", 1),
    "v6e": ("v6e", 1),
}
# Said to libtpu for a name that is not a topology of these generations: libtpu refuses the name itself (the plan's
# one-line error quotes it), and with an accelerator type it knows it prints no warning of its own before ours.
NOT_A_TOPOLOGY_TYPE = "v4-8"


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
    """Set ``JAX_PLATFORMS`` for a machine without a TPU, unless the user set it. Best called before jax is
    imported; a script that imported jax first (but started no backend yet) gets the same choice through jax's
    config, unless it chose platforms itself."""
    if "JAX_PLATFORMS" in os.environ:
        return
    platforms = platforms_without_tpu()
    if not platforms:
        return
    os.environ["JAX_PLATFORMS"] = platforms
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "config") and not jax.config.jax_platforms:
        jax.config.update("jax_platforms", platforms)


def describe_host_to_libtpu(topology: str) -> None:
    """Before libtpu loads to compile for ``topology`` (``v5p:4x4x8``) where no TPU is attached: say what the TPU
    metadata server would (no server to ask; the accelerator type of the topology; one worker, this host), which
    libtpu otherwise asks for and warns about in five lines. Values already set, and machines with a TPU, are
    left as they are."""
    if platforms_without_tpu() is None:
        return
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    generation, _, shape = topology.partition(":")
    dims = shape.split("x")
    if generation in ACCELERATOR_TYPES and all(dim.isdigit() for dim in dims):
        prefix, cores_per_chip = ACCELERATOR_TYPES[generation]
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{prefix}-{math.prod(map(int, dims)) * cores_per_chip}")
    else:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", NOT_A_TOPOLOGY_TYPE)
