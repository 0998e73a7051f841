"""Mixture resume cost: time from "start a mixture at position p" to the first batch in hand, at p = 0 and
p = 10^12, with a data schedule of several weight changes recorded (the ratio should be ~1: flat in p).

Three virtual sources (10^9, 10^7 and 10^4 records, computed from the index: no storage) mixed 5:3:2, global
batch 256; the loader is built and restored from a checkpoint meta at each position, as a resumed run does.
Usage: ``python bench/bench_mixture_resume.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from functrain.data import BatchLoader, Mixture, MixtureSampler

BATCH = 256
FEATURES = 16
REPEATS = 7
SIZES = (10**9, 10**7, 10**4)


class VirtualSource:
    """``size`` records computed from the index: x a smooth function of it, y = index % 10."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        phase = indices[:, None].astype(np.float64) * (1.0 + np.arange(FEATURES)) * 1e-3
        return {"x": np.sin(phase).astype(np.float32), "y": (indices % 10).astype(np.int32)}


def _mixture(weights: tuple[float, ...]) -> Mixture:
    return Mixture([(VirtualSource(size), weight) for size, weight in zip(SIZES, weights)])


def schedule_meta(position: int) -> dict:
    """A checkpoint meta at ``position`` after weight changes at 1/4, 1/2 and 3/4 of it."""
    sampler = MixtureSampler(_mixture((5, 3, 2)), BATCH, seed=1234)
    for change, weights in zip((position // 4, position // 2, 3 * position // 4), ((1, 1, 1), (2, 1, 1), (5, 3, 2))):
        changed = MixtureSampler(_mixture(weights), BATCH, seed=1234)
        changed.restore(sampler.extra_meta(change), change)
        sampler = changed
    return sampler.extra_meta(position)


def time_resume(position: int, meta: dict) -> float:
    """Seconds from building the mixture order + loader at ``position`` (restored from ``meta``) to a batch."""
    started = time.perf_counter()
    sampler = MixtureSampler(_mixture((5, 3, 2)), BATCH, seed=1234)
    sampler.restore(meta, position)
    batch, _ = BatchLoader(sampler.mixture, sampler, prefetch=0).host_batch(position)
    elapsed = time.perf_counter() - started
    assert batch["x"].shape == (BATCH, FEATURES)
    return elapsed


def main() -> None:
    print(f"mixture resume: sources of {', '.join(f'{n:.0e}' for n in SIZES)} records mixed 5:3:2, global batch "
          f"{BATCH}, 3 weight changes on record, median of {REPEATS}")
    medians = {}
    for position in (0, 10**12):
        meta = schedule_meta(position)
        times = [time_resume(position, meta) for _ in range(REPEATS)]
        medians[position] = statistics.median(times)
        print(f"  position {position:>14,}: {medians[position] * 1e3:7.2f} ms to the first batch")
    print(f"ratio (10^12 / 0): {medians[10**12] / medians[0]:.2f}x  (flat = ~1)")


if __name__ == "__main__":
    main()
