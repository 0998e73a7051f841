"""Resume cost: time from "start the data at position p" to the first batch in hand.

functrain computes the batch at p (O(1) in p and memory); the baseline, ``accelerate.skip_first_batches`` on
a shuffled map-style torch DataLoader, walks the sampler past every skipped batch. Both are measured here,
in the same run. Usage: ``python bench/bench_data_resume.py``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import psutil

from functrain.data import BatchLoader, IndexSampler

NUM_RECORDS = 10**9
BATCH = 256
FEATURES = 16
REPEATS = 7


class VirtualSource:
    """10^9 records computed from the index (no storage): x = a smooth function of the index, y = index % 10."""

    def __len__(self) -> int:
        return NUM_RECORDS

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        phase = indices[:, None].astype(np.float64) * (1.0 + np.arange(FEATURES)) * 1e-3
        return {"x": np.sin(phase).astype(np.float32), "y": (indices % 10).astype(np.int32)}


def _rss() -> int:
    return psutil.Process().memory_info().rss


def time_functrain_resume(position: int, prefetch: int) -> tuple[float, int]:
    """Seconds from building sampler + loader at ``position`` to the first batch, and the RSS growth."""
    rss_before = _rss()
    started = time.perf_counter()
    sampler = IndexSampler(NUM_RECORDS, BATCH, seed=1234)
    with BatchLoader(VirtualSource(), sampler, prefetch=prefetch).iter_from(position) as calls:
        batch, start, _ = next(calls)
        elapsed = time.perf_counter() - started
        rss_growth = _rss() - rss_before  # while the iterator is alive, prefetched calls included
    assert batch["x"].shape == (1, BATCH, FEATURES) and start == position
    return elapsed, rss_growth


def time_accelerate_skip(num_records: int, batch_size: int, skip_batches: int) -> tuple[float, int]:
    """Seconds from ``skip_first_batches`` on a shuffled map-style DataLoader to the first batch, and RSS growth."""
    import torch
    from accelerate import PartialState
    from accelerate.data_loader import skip_first_batches

    class VirtualDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return num_records

        def __getitem__(self, index: int) -> dict:
            return {"x": torch.full((FEATURES,), float(index)), "y": index % 10}

    PartialState()  # one-off accelerate setup, kept out of the timing
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(VirtualDataset(), batch_size=batch_size, shuffle=True)
    rss_before = _rss()
    started = time.perf_counter()
    batches = iter(skip_first_batches(loader, skip_batches))
    batch = next(batches)
    elapsed = time.perf_counter() - started
    rss_growth = _rss() - rss_before  # while the iterator (and its sampler state) is alive
    assert batch["x"].shape == (batch_size, FEATURES)
    return elapsed, rss_growth


def main() -> None:
    print(f"functrain resume, virtual source of {NUM_RECORDS:.0e} records, global batch {BATCH}, "
          f"median of {REPEATS}")
    time_functrain_resume(0, prefetch=0)  # warm imports and caches
    for prefetch in (0, 2):
        times = []
        for position in (0, 10**6, NUM_RECORDS - 1):
            runs = [time_functrain_resume(position, prefetch) for _ in range(REPEATS)]
            times.append(statistics.median(run[0] for run in runs))
            rss = max(run[1] for run in runs)
            print(f"  prefetch={prefetch}  p={position:>13,d}: {times[-1] * 1e3:7.3f} ms to first batch, "
                  f"RSS growth {rss / 2**20:6.2f} MiB")
        print(f"  prefetch={prefetch}  slowest/fastest position: {max(times) / min(times):.2f}x")

    skip_batches, torch_batch, torch_records = 3 * 10**5, 32, 10**7
    accel_seconds, accel_rss = time_accelerate_skip(torch_records, torch_batch, skip_batches)
    position = skip_batches * torch_batch
    ours = statistics.median(time_functrain_resume(position, 0)[0] for _ in range(REPEATS))
    print(f"accelerate.skip_first_batches, shuffled map-style torch dataset of {torch_records:.0e} records, "
          f"batch {torch_batch}, {skip_batches:,d} batches skipped: {accel_seconds * 1e3:9.1f} ms to first "
          f"batch, RSS growth {accel_rss / 2**20:.1f} MiB")
    print(f"functrain at the same position p={position:,d} (10^9-record source): {ours * 1e3:.3f} ms")
    print(f"ratio accelerate / functrain: {accel_seconds / ours:,.0f}x")


if __name__ == "__main__":
    main()
