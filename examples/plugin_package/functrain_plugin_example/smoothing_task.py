"""The code of ``task: smoothed_classify``: the supervised classifier's data, a label-smoothed cross-entropy.

The task writes its loss on the model's logits (a :class:`~functrain.core.program.TaskLoss`); functrain runs the
forward and adds whatever the model brings (a mixture of experts' balancing terms, its end-of-step update).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functrain.core.fields import canonical, require_builtin
from functrain.core.program import LossContext, Program, TaskLoss, task_program
from functrain.tasks.base import Task, TaskContext, TaskData
from functrain.tasks.supervised.task import TASKS as SUPERVISED

CLASSIFY = SUPERVISED["classify"]


class SmoothedClassify(Task):
    """A classifier on the data's fields, its targets smoothed (``smoothed_classify.smoothing``)."""

    name = "smoothed_classify"

    def data(self, context: TaskContext) -> TaskData:
        """The classify task's data: its fields, checks and transform."""
        return CLASSIFY.data(context)

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        return CLASSIFY.model_inputs(context, data, example_batch)

    def program(
        self, context: TaskContext, data: TaskData, pieces: Any, example_batch: dict[str, np.ndarray]
    ) -> Program:
        fields = require_builtin(data.fields, example_batch)
        smoothing = context.config.section(self.name).smoothing

        def inputs(batch: dict[str, jax.Array]) -> tuple[jax.Array, dict]:
            return canonical(fields, batch)["x"], {}

        def sums(logits: jax.Array, batch: dict[str, jax.Array], _: LossContext):
            batch = canonical(fields, batch)
            classes = logits.shape[-1]
            targets = optax.smooth_labels(jax.nn.one_hot(batch["y"], classes), smoothing)
            weight = batch["weight"].astype(jnp.float32)  # 0 for padding: sums only, the step divides once
            smoothed = optax.softmax_cross_entropy(logits, targets)
            hard = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
            return (smoothed * weight).sum(), weight.sum(), {"hard_loss": (hard * weight).sum()}

        return task_program(pieces, TaskLoss(inputs, sums))


TASKS = {"smoothed_classify": SmoothedClassify()}
