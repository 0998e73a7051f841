"""Where a platform can put arrays besides device memory: the ``pinned_host`` memory space.

Host offload (``model.remat: offload``, ``train.offload_optimizer``) only pays where device and host memory
are different places: on a GPU or TPU. A CPU lists a ``pinned_host`` memory kind too, but it is the same RAM,
so offloading there is refused rather than silently doing nothing.
"""

import jax

HOST_MEMORY_KIND = "pinned_host"
ACCELERATOR_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def host_offload_available() -> bool:
    """True when the default devices are accelerators with a ``pinned_host`` memory space."""
    device = jax.devices()[0]
    kinds = {memory.kind for memory in device.addressable_memories()}
    return device.platform in ACCELERATOR_PLATFORMS and HOST_MEMORY_KIND in kinds


def platform_name() -> str:
    """The default devices' platform and kind, for error messages (``cpu``, ``gpu (NVIDIA H100 80GB HBM3)``)."""
    device = jax.devices()[0]
    return device.platform if device.platform == "cpu" else f"{device.platform} ({device.device_kind})"
