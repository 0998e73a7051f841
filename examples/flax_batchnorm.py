"""A Flax-example-style CNN with BatchNorm, its own loss, data as TFDS gives it: ``{"image", "label"}``.

The model and loss are written as in the Flax examples (``examples/imagenet``): the loss takes the model
state and applies the model with ``train=True, mutable=["batch_stats"]``, returning the updated statistics.
``fit`` carries them in the train state (sharded, checkpointed, restored bitwise on resume). Evaluation calls
the same loss with ``rng=None``: the model then runs on its running averages and the returned state is
discarded. The data is scikit-learn's 8x8 digits as images ``[8, 8, 1]``; no field map is needed.

    python examples/flax_batchnorm.py [RUN_DIR] [MAX_STEPS]
"""

import sys

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import functrain

CONFIG = {
    "run": {"dir": "runs/example_flax_batchnorm"},
    "data": {"global_batch_size": 32},
    "optimizer": {"name": "adamw", "learning_rate": 3e-3},
    "train": {"max_steps": 300},
    "log": {"every_steps": 50, "progress": False},
    "eval": {"every_steps": 100},
}


class CNN(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> Dense -> Dense; returns logits."""
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(16, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(32)(x.reshape((x.shape[0], -1))))
        return nn.Dense(self.classes)(x)


MODEL = CNN()


def loss_fn(params, batch, rng, model_state):
    """Cross-entropy *sums* over the batch (the step divides once), and the updated batch statistics.

    ``rng`` is None in evaluation: the model then uses its running averages and the state is returned as is.
    """
    variables = {"params": params, **model_state}
    if rng is None:
        logits, new_state = MODEL.apply(variables, batch["image"], train=False), model_state
    else:
        logits, new_state = MODEL.apply(variables, batch["image"], train=True, mutable=["batch_stats"])
    weight = batch["weight"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    correct = jnp.argmax(logits, -1) == batch["label"]
    return (losses * weight).sum(), weight.sum(), {"accuracy": (correct * weight).sum()}, new_state


def load_data(eval_records: int = 197) -> tuple[dict, dict]:
    """``(train, eval)`` dicts of ``{"image": float32[N, 8, 8, 1], "label": int32[N]}``."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    cut = len(labels) - eval_records
    return ({"image": images[:cut], "label": labels[:cut]}, {"image": images[cut:], "label": labels[cut:]})


def main(run_dir: str = "runs/example_flax_batchnorm", max_steps: int = 300, **overrides) -> functrain.FitResult:
    train, evaluation = load_data()
    return functrain.fit(CONFIG, model=MODEL, loss_fn=loss_fn, train_data=train, eval_data=evaluation,
                         **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"{result.stop_reason} at step {result.step}: {result.metrics}")
