"""What one accelerator chip offers, by JAX ``device_kind``: HBM, dense bf16 peak FLOP/s and HBM bandwidth.

Public figures (vendor data sheets; TPU numbers per chip as Google's Cloud TPU pages give them). The first
entry whose name is in the device kind wins, so more specific names come first ("TPU v5 lite" before
"TPU v5", "H100 PCIe" before "H100"). :mod:`functrain.report.mfu` reads the peaks, ``functrain plan`` all three.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB, GB, TERA = 2**30, 10**9, 10**12


@dataclass(frozen=True)
class Chip:
    """One chip: ``hbm_bytes`` of memory, ``peak_flops`` dense bf16 FLOP/s, ``hbm_bandwidth`` bytes/s."""

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float


CHIPS = (
    Chip("TPU v4", 32 * GIB, 275 * TERA, 1.2 * TERA),
    Chip("TPU v5 lite", 16 * GIB, 197 * TERA, 0.82 * TERA),  # v5e
    Chip("TPU v5e", 16 * GIB, 197 * TERA, 0.82 * TERA),
    Chip("TPU v5p", 95 * GIB, 459 * TERA, 2.76 * TERA),
    Chip("TPU v5", 95 * GIB, 459 * TERA, 2.76 * TERA),  # v5p reports itself as "TPU v5"
    Chip("TPU v6", 32 * GIB, 918 * TERA, 1.64 * TERA),  # v6e ("TPU v6 lite")
    Chip("H100 PCIe", 80 * GB, 756 * TERA, 2.0 * TERA),
    Chip("GH200", 96 * GB, 989 * TERA, 4.0 * TERA),
    Chip("H100", 80 * GB, 989 * TERA, 3.35 * TERA),
    Chip("H200", 141 * GB, 989 * TERA, 4.8 * TERA),
    Chip("H800", 80 * GB, 989 * TERA, 3.35 * TERA),
    Chip("B200", 180 * GB, 2250 * TERA, 8.0 * TERA),
    Chip("A100-SXM4-40GB", 40 * GB, 312 * TERA, 1.555 * TERA),
    Chip("A100", 80 * GB, 312 * TERA, 2.0 * TERA),
    Chip("A10G", 24 * GB, 125 * TERA, 0.6 * TERA),
    Chip("L40S", 48 * GB, 362 * TERA, 0.864 * TERA),
    Chip("L4", 24 * GB, 121 * TERA, 0.3 * TERA),
    Chip("V100", 32 * GB, 125 * TERA, 0.9 * TERA),
)


def chip_of(device_kind: str) -> Chip | None:
    """The chip of this JAX device kind, or None when unknown (CPUs among them)."""
    for chip in CHIPS:
        if chip.name.lower() in device_kind.lower():
            return chip
    return None
