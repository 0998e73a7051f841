"""What checking every batch at the data edge costs (issue 16): fit with the per-batch check against fit with an
empty check, on the digits MLP and the char GPT, interleaved and paired.

The check (functrain.data.validate.BatchCheck) runs where batches are assembled: one min and one max of each
integer field the model reads (labels, token ids). Printed per job: steps/s with and without it, the median of
the paired ratios (target >= 0.98x), and the check's own time per batch against the step time, which is the
steadier figure on a busy machine.

    python bench/bench_validation.py [--repeats 5]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loop import LogClock  # noqa: E402

import functrain.tasks.supervised.task  # noqa: E402
from functrain import fit  # noqa: E402
from functrain.config.load import load_config  # noqa: E402
from functrain.data import BatchLoader, IndexSampler  # noqa: E402
from functrain.data.validate import BatchCheck  # noqa: E402
from functrain.data.datasets import load_dataset  # noqa: E402
from functrain.models import family_named  # noqa: E402
from functrain.core.fields import resolve_fields  # noqa: E402
from functrain.core.losses import batch_check  # noqa: E402

JOBS = {  # config, steps, steps per call, first timed step (a multiple of the log interval, 20)
    "digits MLP": ("configs/mlp_digits.yaml", 1200, 1, 200),
    "char GPT": ("configs/char_gpt.yaml", 160, 10, 40),
}


def run_fit(config_path: str, steps: int, steps_per_call: int, warmup: int, checked: bool) -> float:
    unchecked = lambda fields, model_config, source="": BatchCheck([])  # noqa: E731
    functrain.tasks.supervised.task.batch_check = batch_check if checked else unchecked
    clock = LogClock(warmup, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        fit(config_path, callbacks=[clock], **{
            "run.dir": run_dir, "train.max_steps": steps, "train.steps_per_call": steps_per_call,
            "log.every_steps": 20, "checkpoint.every_steps": 0,
            "eval.every_steps": 0, "data.eval_fraction": 0.0, "log.tensorboard": False, "log.progress": False,
            "optimizer.warmup_steps": 0})
    return clock.steps_per_sec()


def check_time_per_batch(config_path: str, batches: int = 2000) -> float:
    """Seconds the check of one batch takes (the batches are built once, outside the timing)."""
    config = load_config(config_path)
    train, _ = load_dataset(config.data)
    loader = BatchLoader(train, IndexSampler(len(next(iter(train.values()))), config.data.global_batch_size, 0),
                         prefetch=0)
    batch, _ = loader.host_batch(0)
    check = batch_check(resolve_fields(batch, kind=family_named(config.model.name).kind), config.model)
    start = time.perf_counter()
    for _ in range(batches):
        check(batch, None)
    return (time.perf_counter() - start) / batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, (config_path, steps, per_call, warmup) in JOBS.items():
        ratios, with_check, without = [], [], []
        for _ in range(args.repeats):
            checked = run_fit(config_path, steps, per_call, warmup, checked=True)
            unchecked = run_fit(config_path, steps, per_call, warmup, checked=False)
            with_check.append(checked)
            without.append(unchecked)
            ratios.append(checked / unchecked)
        step_time = 1 / statistics.median(without)
        per_batch = check_time_per_batch(config_path)
        print(f"{name}: {statistics.median(with_check):.1f} steps/s checked, {statistics.median(without):.1f} "
              f"unchecked; median paired ratio {statistics.median(ratios):.3f}x (runs: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}); the check takes {per_batch * 1e6:.1f} us per batch = "
              f"{per_batch / step_time:.2%} of a step")


if __name__ == "__main__":
    main()
