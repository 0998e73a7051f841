"""A training mode of your own: a regression task (mean squared or Huber error) in one file, registered by name.

functrain's own tasks (a folder each under functrain/tasks/, listed in docs/tasks.md) are plugins of the same shape
as this one: a typed config section named after the task, how the data becomes batches, and the loss on the model's
forward (a TaskLoss). Registered, the task is trained by ``fit`` or a YAML config (``task: regression``), with
everything else of a run: accumulation, sharding, checkpoints, bitwise resume, LoRA on a linen model.

    python examples/regression_task.py [RUN_DIR] [MAX_STEPS]
"""

import sys
from typing import Any, Literal

import flax.linen as nn
import numpy as np
import optax
from pydantic import Field
from sklearn.datasets import load_diabetes

import functrain
from functrain.core.adapters import ModelPieces
from functrain.core.program import LossContext, Program, TaskLoss, task_program
from functrain.core.section import TaskSection
from functrain.errors import DataError
from functrain.tasks import register_task
from functrain.tasks.base import Task, TaskContext, TaskData


class RegressionConfig(TaskSection):
    """``regression.*``: the error (``mse`` or ``huber``) and Huber's ``delta``."""
    loss: Literal["mse", "huber"] = "mse"
    delta: float = Field(1.0, gt=0)


class Regression(Task):
    """Real-valued targets ``y`` ``[N]`` or ``[N, K]`` predicted from inputs ``x``."""

    name = "regression"

    def data(self, context: TaskContext) -> TaskData:
        train, evaluation = context.read_data()
        missing = sorted({"x", "y"} - set(train.gather(np.arange(1))))
        if missing:
            raise DataError(f"task regression reads fields x and y; the data has no {', '.join(missing)}")
        return TaskData(train=train, eval=evaluation, transform=context.transform)

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        return example_batch["x"]

    def program(self, context: TaskContext, data: TaskData, pieces: ModelPieces,
                example_batch: dict[str, np.ndarray]) -> Program:
        section = context.config.section(self.name)

        def inputs(batch):  # what the model's forward reads; the framework runs it (and adds any terms it has)
            return batch["x"], {}

        def sums(predicted, batch, context: LossContext):
            error = predicted.reshape(batch["y"].shape) - batch["y"]
            if section.loss == "huber":
                per_value = optax.huber_loss(error, delta=section.delta)
            else:
                per_value = error ** 2
            per_example = per_value.reshape(len(error), -1).sum(-1)
            weight = batch["weight"]  # 0 for padding: sums only, the step divides once by the total weight
            absolute = abs(error).reshape(len(error), -1).mean(-1)
            return (per_example * weight).sum(), weight.sum(), {"abs_error": (absolute * weight).sum()}

        return task_program(pieces, TaskLoss(inputs, sums))


register_task(Regression(), RegressionConfig)


class MLP(nn.Module):
    """Two hidden layers, one output."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(1)(nn.relu(nn.Dense(64)(x)))[:, 0]


def diabetes() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """scikit-learn's diabetes data, standardised, split 400 / 42."""
    x, y = load_diabetes(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    return {"x": x[:400], "y": y[:400]}, {"x": x[400:], "y": y[400:]}


def main(run_dir: str = "runs/example_regression", max_steps: int = 300) -> functrain.FitResult:
    train, evaluation = diabetes()
    config = {"task": "regression", "regression": {"loss": "huber", "delta": 1.0},
              "run": {"dir": run_dir}, "data": {"global_batch_size": 40},
              "optimizer": {"learning_rate": 3e-3}, "train": {"max_steps": max_steps},
              "log": {"every_steps": 50, "progress": False}, "eval": {"every_steps": 100}}
    return functrain.fit(config, model=MLP(), train_data=train, eval_data=evaluation)


if __name__ == "__main__":
    result = main(*sys.argv[1:2], *map(int, sys.argv[2:3]))
    print(f"stopped at step {result.step}: eval {result.metrics.get('eval')}")
