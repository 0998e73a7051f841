"""Bring your own model as two plain functions and your own loss.

``init(rng, example_batch) -> params`` and ``apply(params, inputs) -> logits``, wrapped as
``functrain.FunctionalModel``; the loss follows functrain's contract and returns *sums*
``(loss_sum, weight, aux_sums)``, so gradient accumulation and multi-device runs divide once by the true
total (never a mean of means). The parameters carry no logical axis names: on a mesh with ``fsdp`` > 1
the default rule shards each over its largest divisible dimension (or give ``mesh.param_rules``).

    python examples/plain_functions.py [RUN_DIR] [MAX_STEPS]
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import functrain

CONFIG = {
    "run": {"dir": "runs/example_functions"},
    "data": {"global_batch_size": 32},
    "train": {"max_steps": 300},
    "log": {"every_steps": 50, "progress": False},
}


def init(rng: jax.Array, example_batch: dict) -> dict:
    """A two-layer perceptron sized from the example batch."""
    features, hidden = example_batch["x"].shape[-1], 64
    first, second = jax.random.split(rng)
    return {"w1": jax.random.normal(first, (features, hidden)) / jnp.sqrt(features), "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(second, (hidden, 10)) / jnp.sqrt(hidden), "b2": jnp.zeros(10)}


def apply(params: dict, x: jax.Array) -> jax.Array:
    return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params: dict, batch: dict, rng: jax.Array):
    """Label-smoothed cross-entropy, summed over the (weighted) examples."""
    logits = apply(params, batch["x"])
    targets = optax.smooth_labels(jax.nn.one_hot(batch["y"], 10), 0.1)
    weight = batch["weight"]  # 0 for padding records
    losses = optax.softmax_cross_entropy(logits, targets)
    correct = (jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32)
    return jnp.sum(losses * weight), jnp.sum(weight), {"accuracy": jnp.sum(correct * weight)}


def load_data() -> dict[str, np.ndarray]:
    digits = load_digits()
    return {"x": (digits.data / 16.0).astype(np.float32), "y": digits.target.astype(np.int32)}


def main(run_dir: str = "runs/example_functions", max_steps: int = 300, **overrides) -> functrain.FitResult:
    return functrain.fit(CONFIG, model=functrain.FunctionalModel(init, apply), loss_fn=loss_fn,
                         optimizer=optax.sgd(0.1, momentum=0.9), train_data=load_data(),
                         **{"run.dir": run_dir, "train.max_steps": max_steps, **overrides})


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"{result.stop_reason} at step {result.step}: {result.metrics}")
