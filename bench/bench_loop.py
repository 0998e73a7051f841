"""fit() against a hand-written jax.jit loop doing the same math, on the digits MLP (issue 2).

Both use the same model, optimizer (AdamW + cosine schedule + clipping), batch size and data order. Measured
in one run, after compilation:
  - fit with per-step callbacks: steps_per_call=1, so on_step_end (progress bar, periodic actions, a user
    callback) fires after every step; metrics logged every 16 steps
  - fit logging every step (a metrics line each step: every step's metrics copied to the host), for information
  - fit with steps_per_call=16
  - the hand-written loop: the same step (functrain.make_train_step) under jax.jit, numpy batches
Prints steps/s and two ratios against the hand-written loop: best run over best run, and the median of
the ratios of runs made side by side (robust to the machine's drift). Targets: per-step callbacks
>= 0.95x, steps_per_call=16 >= 1.2x.

    python bench/bench_loop.py [--steps 2000] [--repeats 7]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from functrain import TrainState, fit, make_train_step  # noqa: E402
from functrain.callbacks.base import Callback  # noqa: E402
from functrain.config.load import load_config  # noqa: E402
from functrain.data import IndexSampler  # noqa: E402
from functrain.data.datasets import load_dataset  # noqa: E402
from functrain.run.parts import make_optimizer  # noqa: E402
from functrain.models import build_model  # noqa: E402
from functrain.core.program import as_program  # noqa: E402

WARMUP_STEPS = 160  # excludes compilation and the first calls from every measurement


class LogClock(Callback):
    """Times the span between two logged steps: a logged step's metrics are materialised, so its
    computation is finished when on_log fires."""

    def __init__(self, start_step: int, end_step: int) -> None:
        self.start_step, self.end_step = start_step, end_step
        self.start = self.end = None
        self.step_ends = 0

    def on_step_end(self, view):
        self.step_ends += 1

    def on_log(self, view, split, step, metrics):
        if split == "train" and step == self.start_step:
            self.start = time.perf_counter()
        if split == "train" and step == self.end_step:
            self.end = time.perf_counter()

    def steps_per_sec(self) -> float:
        return (self.end_step - self.start_step) / (self.end - self.start)


def bench_fit(config, steps: int, steps_per_call: int, log_every: int) -> float:
    clock = LogClock(WARMUP_STEPS, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        fit(config, callbacks=[clock], **{"run.dir": run_dir, "train.max_steps": steps,
                                          "train.steps_per_call": steps_per_call, "log.every_steps": log_every,
                                          "checkpoint.every_steps": 0, "eval.every_steps": 0,
                                          "data.eval_fraction": 0.0, "log.tensorboard": False})
    assert clock.step_ends == steps // steps_per_call  # the callbacks really ran at every call boundary
    return clock.steps_per_sec()


def bench_hand_written(config, steps: int) -> float:
    """The loop a researcher writes by hand around the same jitted step (functrain.make_train_step: the
    same loss, clipping, optimizer, schedule and non-finite guard), fed numpy batches; no callbacks, no
    metrics read back, nothing written. What fit does beyond this is the overhead measured."""
    train, _ = load_dataset(config.data)
    sampler = IndexSampler(len(train["y"]), config.data.global_batch_size, config.seed)
    weight = np.ones(config.data.global_batch_size, np.float32)
    program = as_program(build_model(config.model), {"x": train["x"][:2], "y": train["y"][:2], "weight": weight[:2]})
    tx, schedule = make_optimizer(config.optimizer, steps)
    step = jax.jit(make_train_step(program.loss_fn, tx, clip_norm=config.train.clip_norm, learning_rate_fn=schedule,
                                   stateful=True), donate_argnums=0)
    state = TrainState.create(program.init(jax.random.PRNGKey(0))[0], tx, jax.random.PRNGKey(1))
    for i in range(steps):
        if i == WARMUP_STEPS:
            jax.block_until_ready(state)
            start = time.perf_counter()
        indices = sampler.batch_indices(i)
        state, _ = step(state, {"x": train["x"][indices], "y": train["y"][indices], "weight": weight})
    jax.block_until_ready(state)
    return (steps - WARMUP_STEPS) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    config = load_config("configs/mlp_digits.yaml", ["log.progress=true"])  # the job as configured
    results = {"hand-written jit loop": [], "fit, per-step callbacks": [], "fit, logging every step": [],
               "fit, steps_per_call=16": []}
    for _ in range(args.repeats):  # interleaved, so machine noise hits every variant alike
        results["hand-written jit loop"].append(bench_hand_written(config, args.steps))
        results["fit, per-step callbacks"].append(bench_fit(config, args.steps, 1, 16))
        results["fit, logging every step"].append(bench_fit(config, args.steps, 1, 1))
        results["fit, steps_per_call=16"].append(bench_fit(config, args.steps, 16, 16))
    baseline = results["hand-written jit loop"]
    print(f"\n{'variant':28s} {'steps/s (best of %d)' % args.repeats:>22s} {'best/best':>10s} "
          f"{'median of paired ratios':>24s}")
    for name, values in results.items():
        paired = statistics.median(value / base for value, base in zip(values, baseline))
        print(f"{name:28s} {max(values):22.1f} {max(values) / max(baseline):9.2f}x {paired:23.2f}x")
    print("targets: per-step callbacks >= 0.95x, steps_per_call=16 >= 1.2x")


if __name__ == "__main__":
    main()
