"""The supervised tasks, ``classify`` and ``causal_lm``, the built-in losses on data as users have it.

The data's fields decide the loss (:mod:`functrain.core.fields`: ``x``/``image`` + ``y``/``label`` train a
classifier, ``tokens`` or HF ``input_ids`` a causal LM); ``task: classify`` / ``task: causal_lm`` (or a registry
model's kind, ``model.kind``) say it when the fields alone cannot. A user ``loss_fn`` replaces the built-in loss;
these are the tasks that run on ``backend: torch`` too.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from functrain.core.adapters import ModelPieces, model_inputs_of
from functrain.core.capabilities import BACKENDS
from functrain.core.fields import Fields, require_builtin, resolve_fields
from functrain.core.losses import batch_check
from functrain.core.program import Program, builtin_program, user_program
from functrain.data.transforms import apply_transform
from functrain.errors import ConfigError
from functrain.tasks.base import Task, TaskContext, TaskData

# task name -> the built-in loss it trains (None: the one the data's fields call for).
LOSS_KINDS = {"classify": "classifier", "causal_lm": "causal_lm", "supervised": None}


def first_record(train: Any, transform: Any, seed: int) -> dict[str, np.ndarray]:
    """The training data's first record as a batch of one, transformed as the loader will."""
    example = train.gather(np.arange(1))
    return example if transform is None else apply_transform(example, transform, seed, np.arange(1))


class Supervised(Task):
    """A classifier or a causal LM on the data's fields, with the built-in loss or the user's."""

    backends = tuple(BACKENDS)  # every backend runs the built-in losses and user losses
    takes_loss_fn = True

    def __init__(self, name: str) -> None:
        self.name = name  # type: ignore[misc]  # one class, registered under three names
        self.loss_kind = LOSS_KINDS[name]

    def kind(self, context: TaskContext) -> str | None:
        """The loss the task or the model's config names (None: the data decides); the two must agree."""
        model_kind = context.model_kind
        if self.loss_kind and model_kind and model_kind != self.loss_kind:
            raise ConfigError(
                f"task {self.name} trains a {self.loss_kind} and the model is a {model_kind}; set "
                f"task: {'classify' if model_kind == 'classifier' else model_kind} or choose a "
                f"{self.loss_kind} model"
            )
        return self.loss_kind or model_kind

    def data(self, context: TaskContext) -> TaskData:
        """The config's (or ``fit``'s) data with the roles of its fields; with the built-in loss, what it reads is
        checked on every batch."""
        config = context.config
        train, evaluation = context.read_data()
        mapped, kind = config.data.fields, self.kind(context)
        fields: Fields | None = None
        check = None
        # A linen model is initialised on its input field, so the roles are read for it even under a user loss.
        if (
            context.loss_fn is None
            or mapped.inputs is not None
            or mapped.labels is not None
            or _is_linen(context.model)
        ):
            example = first_record(train, context.transform, context.data_seed)
            fields = resolve_fields(example, inputs=mapped.inputs, labels=mapped.labels, kind=kind)
            if context.loss_fn is None:
                fields = require_builtin(fields, example)
                named = (
                    config.data.path
                    or config.data.target
                    or ("data.sources" if config.data.sources else config.data.name)
                )
                where = "train_data" if context.data_given else f"the data ({named})"
                check = batch_check(fields, config.model, source=where)
        trained = fields.kind if context.loss_fn is None and fields is not None else kind
        tokens = config.data.seq_len if trained == "causal_lm" else None
        return TaskData(
            train=train,
            eval=evaluation,
            batch_check=check,
            fields=fields,
            transform=context.transform,
            tokens_per_sample=tokens,
        )

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        """What the model is called on: the built-in loss's inputs, or the named input field."""
        if data.fields is None and _is_linen(context.model):
            require_builtin(None, example_batch)  # names the missing input and the setting that fixes it
        return model_inputs_of(data.fields, example_batch)

    def program(
        self, context: TaskContext, data: TaskData, pieces: ModelPieces, example_batch: dict[str, np.ndarray]
    ) -> Program:
        if context.loss_fn is not None:
            return user_program(pieces, context.loss_fn, example_batch)
        fields = require_builtin(data.fields, example_batch)
        return builtin_program(pieces, fields, example_batch, context.config.train.logits_chunk)


def _is_linen(model: Any) -> bool:
    import flax.linen as nn

    return isinstance(model, nn.Module)


TASKS = {name: Supervised(name) for name in LOSS_KINDS}
