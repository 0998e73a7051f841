"""Logging every step to every tracker against metrics.jsonl alone, on the char GPT (issue 13).

``configs/char_gpt.yaml`` with ``train.steps_per_call=1`` and ``log.every_steps=1`` (every step's metrics go
to the host and to each tracker), trained with ``log.trackers=[jsonl]`` and with
``[jsonl, tensorboard, wandb, mlflow]`` (W&B offline, MLflow file store), runs interleaved. Steps/s is the
median of the loop's logged ``steps_per_sec`` after a warm-up (compilation and tracker start-up excluded).
Prints both and the cost of the trackers. Target: <= 5%.

    python bench/bench_trackers.py [--steps 300] [--repeats 3]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from functrain import fit  # noqa: E402

WARMUP_STEPS = 50
SETTINGS = {"jsonl only": ["jsonl"], "all trackers": ["jsonl", "tensorboard", "wandb", "mlflow"]}


def steps_per_second(trackers: list[str], steps: int, workdir: str) -> float:
    run_dir = tempfile.mkdtemp(dir=workdir)
    fit("configs/char_gpt.yaml", **{"run.dir": run_dir, "train.max_steps": steps, "train.steps_per_call": 1,
                                    "log.every_steps": 1, "log.trackers": trackers, "log.progress": False,
                                    "log.plot": False, "eval.every_steps": 0, "eval.max_batches": 1,
                                    "eval.samples.count": 0, "checkpoint.every_steps": 0})
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return statistics.median(line["steps_per_sec"] for line in lines
                             if line["split"] == "train" and line["step"] > WARMUP_STEPS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    rates = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as workdir:
        for _ in range(args.repeats):
            for name, trackers in SETTINGS.items():
                rates[name].append(steps_per_second(trackers, args.steps, workdir))
    best = {name: max(values) for name, values in rates.items()}
    paired = [1 - a / b for a, b in zip(rates["all trackers"], rates["jsonl only"])]
    for name, values in rates.items():
        print(f"  {name:14s} {best[name]:8.1f} steps/s best ({', '.join(f'{v:.1f}' for v in values)})")
    print(f"  cost of all trackers: {100 * (1 - best['all trackers'] / best['jsonl only']):.1f}% best/best, "
          f"{100 * statistics.median(paired):.1f}% median of paired runs (target <= 5%)")


if __name__ == "__main__":
    main()
