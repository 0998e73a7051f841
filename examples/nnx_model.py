"""Bring your own Flax NNX model (the API the Flax docs teach): the module is built with its own
``nnx.Rngs``; functrain splits it into a graph definition and state (``nnx.split``), keeps the step pure,
and reseeds its dropout stream from the step key, so a resumed run draws the same masks.

The optimizer is a function of the schedule: the config's warmup and cosine decay drive it and are
reported as ``learning_rate``.

    python examples/nnx_model.py [RUN_DIR] [MAX_STEPS]
"""

import sys

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import functrain

CONFIG = {
    "run": {"dir": "runs/example_nnx"},
    "data": {"global_batch_size": 32},
    "optimizer": {"learning_rate": 3e-3, "schedule": "cosine", "warmup_steps": 20},
    "train": {"max_steps": 300},
    "log": {"every_steps": 50, "progress": False},
}


class MLP(nnx.Module):
    """Linear -> ReLU -> Dropout -> Linear; returns logits."""

    def __init__(self, features: int, hidden: int, classes: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(features, hidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(hidden, classes, rngs=rngs)

    def __call__(self, x):
        return self.out(self.dropout(nnx.relu(self.hidden(x))))


def build_model(hidden: int = 64, seed: int = 0) -> MLP:
    return MLP(64, hidden, 10, nnx.Rngs(params=seed, dropout=seed + 1))


def load_data() -> dict[str, np.ndarray]:
    digits = load_digits()
    return {"x": (digits.data / 16.0).astype(np.float32), "y": digits.target.astype(np.int32)}


def make_optimizer(schedule: optax.Schedule) -> optax.GradientTransformation:
    return optax.adamw(schedule, weight_decay=1e-4)


def main(run_dir: str = "runs/example_nnx", max_steps: int = 300, **overrides) -> functrain.FitResult:
    return functrain.fit(CONFIG, model=build_model(), optimizer=make_optimizer, train_data=load_data(),
                         **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"{result.stop_reason} at step {result.step}: {result.metrics}")
