"""The distillation task: a causal LM (the student) trained on a frozen teacher's next-token distributions.

The data is the causal-LM task's (tokens, HF ``input_ids``/``labels``, packed windows). In each step the student
and the teacher run on the same inputs; the loss (:func:`functrain.tasks.distill.loss.distill_sums`) mixes the
divergence of their tempered distributions with the student's cross-entropy on the text, summed over the tokens
the causal-LM loss counts. Evaluation reports the student's cross-entropy as ``loss`` (what the student is, and
what a run without a teacher reports, so the two compare), with the divergence (``distill``) beside it.

The teacher's weights live in the model state under ``teacher``: never differentiated, never seen by the
optimizer, sharded by their own logical axes under the run's mesh rules, saved with every checkpoint and
restored with the state (a resumed run reads them from its own checkpoint, so it stays bitwise). A start that
does not hold them (a fresh start, ``train.init_from``, a converted checkpoint) has them loaded by the task's
start hook (:class:`LoadTeacher`) from ``distill.teacher`` before the first step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec

from functrain.core.adapters import ModelPieces, init_shapes, model_pieces
from functrain.core.fields import Fields, canonical, require_builtin
from functrain.core.losses import JAX_OPS, model_inputs, model_keywords
from functrain.core.precision import COMPUTE_DTYPES
from functrain.core.program import LossContext, Program, TaskLoss, TaskState, check_logits, task_program
from functrain.errors import CheckpointError, ConfigError
from functrain.tasks.base import ExperienceStage, StartHook, Task, TaskContext, TaskData
from functrain.tasks.distill.config import DistillConfig
from functrain.tasks.distill.loss import distill_sums
from functrain.tasks.distill.teacher import Teacher, check_teacher, open_teacher
from functrain.tasks.supervised.task import TASKS as SUPERVISED_TASKS

TEACHER = "teacher"  # the model-state entry: {"params": the teacher's weights, "loaded": 1 once they are}
CAUSAL_LM = SUPERVISED_TASKS["causal_lm"]


class Distill(Task):
    """A causal LM distilled from a frozen teacher (``distill.*``, see the module docstring)."""

    name = "distill"

    def check(self, context: TaskContext) -> None:
        """Backend jax and no user loss (the base's checks), and a teacher that opens, before any data is read."""
        super().check(context)
        self.teacher(context)

    def data(self, context: TaskContext) -> TaskData:
        """The causal-LM task's data (its fields, checks and tokens per sample)."""
        return CAUSAL_LM.data(context)

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        return CAUSAL_LM.model_inputs(context, data, example_batch)

    def teacher(self, context: TaskContext) -> Teacher:
        """The teacher of ``distill.teacher``, computing in ``train.compute_dtype``."""
        section: DistillConfig = context.config.section(self.name)
        if section.teacher is None:
            raise ConfigError(
                "task distill needs a teacher; set distill.teacher to a functrain run directory or an "
                "HF checkpoint directory"
            )
        return open_teacher(
            section.teacher, step=section.teacher_step, dtype=COMPUTE_DTYPES[context.config.train.compute_dtype]
        )

    def program(
        self, context: TaskContext, data: TaskData, pieces: ModelPieces, example_batch: dict[str, np.ndarray]
    ) -> Program:
        """The student's pieces and the teacher's frozen forward in one loss, once the teacher is checked against
        the student's logits and the data's windows."""
        fields = require_builtin(data.fields, example_batch)
        batch = canonical(fields, example_batch)
        inputs, keywords = model_inputs("causal_lm", batch), model_keywords("causal_lm", batch)
        params, model_state = init_shapes(pieces.init)
        check_logits(pieces.apply, "causal_lm", params, model_state, batch)
        logits = jax.eval_shape(
            lambda p, s: pieces.apply(p, s, inputs, False, jax.random.PRNGKey(0), **keywords).logits,
            params,
            model_state,
        )
        teacher = self.teacher(context)
        check_teacher(teacher, vocab_size=logits.shape[-1], positions=inputs.shape[1])
        teacher_pieces = model_pieces(teacher.module, inputs, example_batch)
        return distill_program(pieces, teacher_pieces, fields, context.config.section(self.name))

    def start_hooks(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> list[StartHook]:
        """Load the teacher's weights where the starting state does not hold them."""
        return [LoadTeacher(self.teacher(context))]

    def experience(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> ExperienceStage | None:
        """With ``distill.lmbda`` above 0, the stage that ends a share of the steps' windows in the student's own
        text (:mod:`functrain.tasks.distill.on_policy`); none otherwise."""
        config, section = context.config, context.config.section(self.name)
        if section.lmbda == 0:
            return None
        fields = data.fields
        if fields is None or fields.hf or config.data.packing or config.model.registry_name() is None:
            raise ConfigError(
                "distill.lmbda samples the student's continuations of token windows: it needs a built-in causal "
                "LM (model.name) on unpacked tokens (not HF input_ids, not data.packing); set distill.lmbda=0"
            )
        from functrain.tasks.distill.on_policy import OnPolicy
        from functrain.tasks.sampling import Sampler

        sampler = Sampler(
            config.model,
            pieces,
            config.train.compute_dtype,
            max_new_tokens=section.max_new_tokens,
            temperature=section.temperature,
            precision=config.train.matmul_precision,
            deterministic=config.train.deterministic,
        )
        return OnPolicy(sampler, fields.inputs, section.lmbda, section.max_new_tokens)


def distill_program(student: ModelPieces, teacher: ModelPieces, fields: Fields, section: DistillConfig) -> Program:
    """The Program of ``student`` distilled from ``teacher``: its model state holds the teacher's weights under
    :data:`TEACHER` (zeros until :class:`LoadTeacher` loads them)."""
    sums = functools.partial(
        distill_sums, loss=section.loss, beta=section.beta, temperature=section.temperature, alpha=section.alpha
    )

    def entries(params: Any) -> dict[str, Any]:
        shapes = init_shapes(teacher.init)[0]
        weights = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shapes)
        return {TEACHER: {"params": weights, "loaded": jnp.zeros((), jnp.int32)}}

    def state_logical_specs() -> dict[str, Any]:
        return {TEACHER: {"params": teacher.logical_specs(), "loaded": PartitionSpec()}}

    def inputs(batch: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        batch = canonical(fields, batch)
        return model_inputs("causal_lm", batch), model_keywords("causal_lm", batch, JAX_OPS)

    def distill_sums_of(logits: Any, batch: dict[str, Any], context: LossContext):
        teacher_inputs, keywords = inputs(batch)
        frozen = context.model_state[TEACHER]
        teacher_output = teacher.apply(frozen["params"], {}, teacher_inputs, False, context.rng, **keywords)
        loss_sum, count, aux = sums(logits, jax.lax.stop_gradient(teacher_output.logits), canonical(fields, batch))
        if not context.train:  # the student's cross-entropy: comparable with a run that has no teacher
            loss_sum = aux["cross_entropy"]
        return loss_sum, count, aux

    state = TaskState((TEACHER,), entries, logical_specs=state_logical_specs)
    return task_program(student, TaskLoss(inputs, distill_sums_of, state=state))


class LoadTeacher:
    """Start hook: put the teacher's weights (read from ``distill.teacher``) into a starting state that does not
    hold them yet, straight into their shardings; a state restored from this run's checkpoints already does."""

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher

    def __call__(self, backend: Any, state: Any, restored_step: int | None) -> Any:
        entry = state.model_state[TEACHER]
        if int(np.asarray(entry["loaded"].addressable_data(0))):
            return state
        shardings = backend.state_shardings.model_state[TEACHER]
        abstract = backend.abstract_state.model_state[TEACHER]["params"]
        weights = fitted(self.teacher.load_params(), abstract, self.teacher)
        placed = jax.tree.map(placed_on, weights, shardings["params"])
        loaded = placed_on(np.ones((), np.int32), shardings["loaded"])
        return state.replace(model_state={**state.model_state, TEACHER: {"params": placed, "loaded": loaded}})


def fitted(weights: Any, abstract: Any, teacher: Teacher) -> Any:
    """``weights`` (numpy) in the structure and dtypes of ``abstract``; a leaf missing or of another shape is a
    one-line CheckpointError naming it."""
    given, wanted = flatten_dict(weights), flatten_dict(abstract)
    for path in sorted(set(given) | set(wanted)):
        shape = tuple(np.shape(given[path])) if path in given else None
        if shape != (tuple(wanted[path].shape) if path in wanted else None):
            raise CheckpointError(
                f"the weights of the teacher {teacher.source} do not fit its model: {'/'.join(path)} "
                f"is {shape} there and {wanted[path].shape if path in wanted else None} in "
                f"{teacher.config.name}; check the teacher's config"
            )
    return jax.tree.map(lambda leaf, want: np.asarray(leaf, dtype=want.dtype), weights, abstract)


def placed_on(array: np.ndarray, sharding: Any) -> jax.Array:
    """A global array of the host ``array`` (the whole of it on every process) in ``sharding``."""
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


TASKS = {"distill": Distill()}
