"""A user Flax model passed to fit() against the same model through the config registry (issue 15).

The registry run is ``fit(config)`` with ``model.name: mlp`` and ``data.name: digits``; the user run passes
the same module (``functrain.models.mlp.MLP``, built by hand), the same digits arrays as ``train_data`` and
the same config otherwise, so both reach the same compiled step through one builder: the ratio is what being
open costs (target >= 0.95x). Steps/s are timed between two logged steps after compilation (as in
bench_loop.py), over interleaved repeats; printed as best over best and the median of paired ratios.

    python bench/bench_user_model.py [--steps 2000] [--repeats 7] [--steps-per-call 1]
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_loop import WARMUP_STEPS, LogClock  # noqa: E402

from functrain import fit  # noqa: E402
from functrain.config.load import load_config  # noqa: E402
from functrain.data.datasets import load_dataset  # noqa: E402
from functrain.models import build_model  # noqa: E402


def bench(config, steps: int, steps_per_call: int, **objects) -> float:
    clock = LogClock(WARMUP_STEPS, steps)
    with tempfile.TemporaryDirectory() as run_dir:
        fit(config, callbacks=[clock], **objects,
            **{"run.dir": run_dir, "train.max_steps": steps, "train.steps_per_call": steps_per_call,
               "log.every_steps": 16 * steps_per_call, "checkpoint.every_steps": 0, "eval.every_steps": 0,
               "data.eval_fraction": 0.0, "log.tensorboard": False, "log.progress": False})
    return clock.steps_per_sec()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps-per-call", type=int, default=1)
    args = parser.parse_args()
    config = load_config("configs/mlp_digits.yaml", ["data.eval_fraction=0.0"])
    train, _ = load_dataset(config.data)
    registry, user = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        registry.append(bench(config, args.steps, args.steps_per_call))
        user.append(bench(config, args.steps, args.steps_per_call, model=build_model(config.model), train_data=train))
    paired = statistics.median(u / r for u, r in zip(user, registry))
    print(f"\n{'variant':32s} {'steps/s (best of %d)' % args.repeats:>22s}")
    print(f"{'config registry (model.name)':32s} {max(registry):22.1f}")
    print(f"{'user model passed to fit':32s} {max(user):22.1f}")
    print(f"user / registry: best over best {max(user) / max(registry):.2f}x, median of paired ratios "
          f"{paired:.2f}x (each pair: {', '.join(f'{u / r:.2f}' for u, r in zip(user, registry))}); target >= 0.95x")


if __name__ == "__main__":
    main()
