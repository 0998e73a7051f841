"""Bring your own Flax linen model and an HF ``datasets.Dataset`` (no download: the digits that ship
with scikit-learn, put into a Dataset the way you would put your own records).

The model keeps batch statistics (``BatchNorm``): they travel in the train state's ``model_state``,
are updated in training mode and checkpointed with everything else. The loss is the built-in classifier
loss, chosen because the records have ``x`` and ``y``.

    python examples/linen_hf_dataset.py [RUN_DIR] [MAX_STEPS]

The same run from YAML: ``model.target: examples.linen_hf_dataset:build_model`` and
``data.target: examples.linen_hf_dataset:load_data`` (see README, "Bring your own model").
"""

import sys

import datasets
import flax.linen as nn
import numpy as np
from sklearn.datasets import load_digits

import functrain

CONFIG = {
    "run": {"dir": "runs/example_linen"},
    "data": {"global_batch_size": 32},
    "optimizer": {"name": "adamw", "learning_rate": 3e-3},
    "train": {"max_steps": 300},
    "log": {"every_steps": 50, "progress": False},
    "eval": {"every_steps": 100},
}


class Classifier(nn.Module):
    """Dense -> BatchNorm -> ReLU -> Dense; returns logits."""
    hidden: int = 64
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(self.hidden)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(self.classes)(nn.relu(x))


def build_model(hidden: int = 64) -> Classifier:
    """The model factory (``model.target`` calls it with the model section's other keys)."""
    return Classifier(hidden=hidden)


def load_data(eval_records: int = 197) -> tuple[datasets.Dataset, datasets.Dataset]:
    """``(train, eval)`` Datasets of ``{"x": float32[64], "y": int}`` records, read as numpy."""
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    records = datasets.Dataset.from_dict({"x": x, "y": y}).with_format("numpy")
    cut = len(records) - eval_records
    return records.select(range(cut)), records.select(range(cut, len(records)))


def main(run_dir: str = "runs/example_linen", max_steps: int = 300, **overrides) -> functrain.FitResult:
    train, evaluation = load_data()
    return functrain.fit(CONFIG, model=build_model(), train_data=train, eval_data=evaluation,
                         **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"{result.stop_reason} at step {result.step}: {result.metrics}")
