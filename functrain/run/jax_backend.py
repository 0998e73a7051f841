"""The JAX backend: the sharded TrainState and the compiled train and eval calls for the loop.

It implements :class:`functrain.core.backend.Backend` from built pieces (a Program, an optax transformation,
a mesh and its rules, :class:`~functrain.core.step.StepSettings`); the builder makes them from the config.
"""

import contextlib
import hashlib
import json
import logging
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from functrain.checkpoint.layout import EXPERIENCE
from functrain.core.adapters import init_shapes
from functrain.core.fp8 import hardware_note, with_fp8
from functrain.core.precision import (
    COMPUTE_DTYPES,
    LOSS_SCALE_INIT,
    PARAM_DTYPES,
    at_precision,
    cast_floating,
    matmul_precision,
)
from functrain.core.program import Program
from functrain.core.state import TrainState
from functrain.core.step import StepSettings, make_eval_step, make_train_call, make_train_step, trainable_only
from functrain.data import batch_sharding, to_global
from functrain.data.global_array import to_local
from functrain.parallel import distributed, sharding
from functrain.parallel.offload import check_offload, offload_opt_state, streaming_optimizer
from functrain.parallel.pipeline import PipelineSchedule, scheduled

log = logging.getLogger("functrain")

# Folded into the seed's key for the experience stage's keys (then the step): a stream of its own.
EXPERIENCE_STREAM = 0xE4E7

# TrainState fields saved in the checkpoint's "state" item (params are an item of their own).
STATE_FIELDS = (
    "step",
    "opt_state",
    "rng",
    "model_state",
    "loss_scale",
    "good_steps",
    "skipped_steps",
    "nonfinite_steps",
)


def weight_sums(params: Any) -> dict[str, jax.Array]:
    """Per leaf (by path) two position-weighted sums of its float32 bit patterns, modulo 2**32: integer sums do
    not depend on the order of the reduction, so any sharding of the same values gives the same."""

    def sums(leaf: jax.Array) -> jax.Array:
        leaf = jnp.atleast_1d(leaf)
        bits = jax.lax.bitcast_convert_type(leaf.astype(jnp.float32), jnp.uint32)
        position = jax.lax.broadcasted_iota(jnp.uint32, leaf.shape, 0)
        for axis in range(1, leaf.ndim):  # the C-order flat index of every element
            position = position * jnp.uint32(leaf.shape[axis]) + jax.lax.broadcasted_iota(jnp.uint32, leaf.shape, axis)
        mixed = (bits ^ (position * jnp.uint32(0x9E3779B9))) * jnp.uint32(0x85EBCA6B)
        return jnp.stack([jnp.sum(bits * (2 * position + 1), dtype=jnp.uint32), jnp.sum(mixed, dtype=jnp.uint32)])

    return {jax.tree_util.keystr(path): sums(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


class JaxBackend:
    """Everything device-side for one run: mesh, shardings, compiled calls (the :class:`Backend` of JAX)."""

    name = "jax"
    synchronous = False  # calls are dispatched asynchronously; a call is known finished when read

    def __init__(
        self,
        program: Program,
        tx: optax.GradientTransformation,
        schedule: optax.Schedule | None,
        *,
        mesh: Mesh,
        rules: Any,
        param_rules: Any = (),
        allow_replicated_fallback: bool = False,
        step: StepSettings = StepSettings(),
        seed: int = 0,
        experience: Callable[[Any, dict[str, Any], jax.Array, int], dict[str, Any]] | None = None,
        compiler_options: dict[str, str] | None = None,
        pipeline: PipelineSchedule | None = None,
    ) -> None:
        """``schedule`` is reported as the ``learning_rate`` metric (None: not reported); ``rules`` map logical
        axes to mesh axes and ``param_rules`` parameter paths to specs (:mod:`functrain.parallel.sharding`);
        ``experience``: a task's stage that makes each step's training batch from the loader's with the current
        weights (:class:`functrain.tasks.base.ExperienceStage`), or None; ``compiler_options``: XLA options of the
        train call (None: XLA's); ``pipeline``: the schedule of the layers' stages over the mesh's pipeline axis
        (None: the defaults)."""
        self.program, self.mesh, self.seed, self.experience = program, mesh, seed, experience
        self.pipeline = pipeline or PipelineSchedule()
        # An experience stage reads each step's results before the next step can start: a call has (all but) run
        # when train_call returns, so the loop times it then, as a synchronous backend's.
        self.synchronous = experience is not None
        # The experience stage's keys: (seed, step) folded into a stream of their own.
        self.experience_stream = (
            None if experience is None else jax.random.fold_in(jax.random.PRNGKey(seed), EXPERIENCE_STREAM)
        )
        self.process_index, self.process_count = jax.process_index(), jax.process_count()
        self.writes_checkpoints = True  # Orbax writes a checkpoint with every process
        self.devices = list(mesh.devices.flat)  # jax.devices(), or a TPU topology's when planning
        if step.offload_optimizer:
            check_offload()
        compute_dtype = COMPUTE_DTYPES[step.compute_dtype]
        param_dtype = PARAM_DTYPES[step.param_dtype]
        dynamic_scale = step.dynamic_loss_scale
        trainable = None
        if program.trainable is not None:  # frozen leaves (LoRA's base weights): no gradient, no optimizer state
            trainable = program.trainable(init_shapes(program.init)[0])
            tx = trainable_only(tx, trainable)
        self.tx, self.schedule = tx, schedule
        train_step = make_train_step(
            program.loss_fn,
            tx,
            micro_batches=step.micro_batches,
            clip_norm=step.clip_norm,
            compute_dtype=compute_dtype,
            dynamic_loss_scale=dynamic_scale,
            learning_rate_fn=schedule,
            stateful=True,
            trainable=trainable,
            batch_totals=program.batch_totals,
            end_of_step=program.end_of_step,
        )
        eval_step = make_eval_step(program.eval_loss_fn, compute_dtype=compute_dtype, stateful=True)
        self._precision = matmul_precision(step.matmul_precision, step.compute_dtype, self.devices[0].platform)
        train_step, eval_step = at_precision(train_step, self._precision), at_precision(eval_step, self._precision)
        train_step, eval_step = with_fp8(train_step, step.fp8), with_fp8(eval_step, step.fp8)
        if step.fp8 and (note := hardware_note(self.devices[0])):
            log.warning("functrain: warning: %s", note)

        def fresh_state(params: Any, model_state: Any, run_key: jax.Array) -> TrainState:
            params = cast_floating(params, param_dtype)  # train.param_dtype: the stored (master) weights
            return TrainState.create(
                params, tx, run_key, model_state=model_state, loss_scale=LOSS_SCALE_INIT if dynamic_scale else 1.0
            )

        def state_for_params(params: Any, seed: int) -> TrainState:
            init_key, run_key = jax.random.split(jax.random.PRNGKey(seed))
            _, model_state = program.init(init_key)  # the initial params are unused (and compiled away)
            if program.state_for_params is not None:
                model_state = program.state_for_params(params, model_state)
            return fresh_state(params, model_state, run_key)

        def create_state(seed: int) -> TrainState:
            init_key, run_key = jax.random.split(jax.random.PRNGKey(seed))
            return fresh_state(*program.init(init_key), run_key)

        # From init's shapes (traced once for the build), not by tracing the model's init again.
        self.abstract_state = jax.eval_shape(
            lambda params, model_state: fresh_state(params, model_state, jax.random.PRNGKey(0)),
            *init_shapes(program.init),
        )
        self.param_shardings, self.state_shardings = self._shardings(
            program, rules, param_rules, allow_replicated_fallback
        )
        if step.offload_optimizer:
            train_step = streaming_optimizer(train_step, self.state_shardings.opt_state)
            self.state_shardings = offload_opt_state(self.state_shardings)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self.stacked_batch_sharding = batch_sharding(self.mesh, batch_axis=1)
        self.batch_sharding = batch_sharding(self.mesh, batch_axis=0)
        # State goes straight into its shardings: no full copy on one device first.
        self._create = jax.jit(create_state, static_argnums=0, out_shardings=self.state_shardings)
        self._state_for_params = jax.jit(state_for_params, static_argnums=1, out_shardings=self.state_shardings)
        self._train_call = jax.jit(
            make_train_call(train_step),
            donate_argnums=0,
            in_shardings=(self.state_shardings, self.stacked_batch_sharding),
            out_shardings=(self.state_shardings, replicated),
            compiler_options=compiler_options,
        )
        self._eval_step = jax.jit(
            eval_step, in_shardings=(self.state_shardings, self.batch_sharding), out_shardings=replicated
        )
        self._compute_dtype = compute_dtype
        self._weight_sums = jax.jit(weight_sums, out_shardings=replicated)
        # A stage that samples ahead (asynchronous GRPO) samples on a copy of the step's weights: the step donates
        # them, and would wait for the sampler to finish reading them.
        self.ahead = int(getattr(experience, "ahead", 0))
        self._sampler_weights = jax.jit(partial(jax.tree.map, jnp.copy), out_shardings=self.param_shardings)

    def _shardings(
        self, program: Program, rules: Any, param_rules: Any, allow_replicated_fallback: bool
    ) -> tuple[Any, Any]:
        """The params' shardings, from their logical axes and the rules, and the state's, from them (model-state
        entries with logical axes of their own, a teacher's, from theirs)."""
        params = sharding.param_shardings(
            program.logical_specs(),
            self.abstract_state.params,
            self.mesh,
            rules,
            allow_replicated_fallback=allow_replicated_fallback,
            param_rules=param_rules,
        )
        state = sharding.state_shardings(self.abstract_state, params, self.mesh)
        if program.state_logical_specs is not None:  # model-state entries with logical axes of their own (a teacher)
            entries = {
                name: sharding.param_shardings(
                    specs,
                    self.abstract_state.model_state[name],
                    self.mesh,
                    rules,
                    allow_replicated_fallback=allow_replicated_fallback,
                )
                for name, specs in program.state_logical_specs().items()
            }
            state = state.replace(model_state={**state.model_state, **entries})
        return params, state

    @contextlib.contextmanager
    def _traced(self) -> Any:
        """Where the calls are traced and run: under the mesh and the pipeline's schedule."""
        with jax.set_mesh(self.mesh), scheduled(self.pipeline):
            yield

    def init_state(self) -> TrainState:
        """A fresh step-0 state from the config's seed, created in its shardings."""
        with self._traced():
            return self._create(self.seed)

    def restore_targets(self) -> dict[str, Any]:
        """Abstract checkpoint items with the current shardings (so a restore lands on this mesh)."""
        targets = _with_shardings(self.abstract_state, self.state_shardings)
        # A program that completes restored params (LoRA on a converted base model) reads them as saved.
        params = None if self.program.complete_params is not None else targets.params
        items = {"params": params, "state": {name: getattr(targets, name) for name in STATE_FIELDS}}
        if self.ahead:  # the batches an experience stage made ahead (a checkpoint without them starts it afresh)
            example = self.experience.ahead_example()  # type: ignore[union-attr]
            batch = {
                name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=self.batch_sharding)
                for name, value in example.items()
            }
            items[EXPERIENCE] = {str(offset): batch for offset in range(self.ahead)}
        return items

    def state_to_items(self, state: TrainState) -> dict[str, Any]:
        """The checkpoint items of ``state`` (and the batches the experience stage made ahead, if it did)."""
        items = {"params": state.params, "state": {name: getattr(state, name) for name in STATE_FIELDS}}
        made = self.experience.saved_ahead() if self.ahead else []  # type: ignore[union-attr]
        if made:
            batches = to_global(made, self.batch_sharding, batch_axis=0)
            items[EXPERIENCE] = {str(offset): batch for offset, batch in enumerate(batches)}
        return items

    def state_from_items(self, items: dict[str, Any]) -> TrainState:
        """Rebuild a state from restored items (no initial state is built beside it, so a resume needs no
        more memory than the state); without a ``state`` item the optimizer starts fresh."""
        params = items["params"]
        if self.program.complete_params is not None:
            init_key = jax.random.split(jax.random.PRNGKey(self.seed))[0]  # as create_state's
            params = jax.device_put(self.program.complete_params(params, init_key), self.param_shardings)
        if items.get("state") is None:
            with self._traced():
                return self._state_for_params(params, self.seed)
        saved = dict(items["state"])
        saved.setdefault("model_state", {})  # an empty collection is not stored
        if self.ahead and items.get(EXPERIENCE) is not None:
            made = [items[EXPERIENCE][str(offset)] for offset in range(len(items[EXPERIENCE]))]
            local = [{name: to_local(value) for name, value in batch.items()} for batch in made]
            self.experience.restore_ahead(int(jax.device_get(saved["step"])), local)  # type: ignore[union-attr]
        return TrainState(params=params, **{name: saved[name] for name in STATE_FIELDS})

    def place(self, host_batches: dict[str, np.ndarray]) -> dict[str, jax.Array] | dict[str, np.ndarray]:
        """Host batches ``[K, B_local, ...]`` -> global arrays sharded over the batch axes.

        With one process the numpy arrays are handed to the compiled call as they are: its input shardings
        place them on the way in (in C++), which costs less than a Python ``device_put`` of each batch. An
        experience stage reads this process's rows as they are, and its batch is placed when it is made.
        """
        return host_batches if self.experience is not None else self._global_calls(host_batches)

    def _global_calls(self, host_batches: dict[str, np.ndarray]) -> dict[str, Any]:
        """This process's calls ``[K, B_local, ...]`` as the train call takes them (as they are on one process)."""
        if jax.process_count() == 1:
            return host_batches
        return to_global(host_batches, self.stacked_batch_sharding, batch_axis=1)

    def train_call(self, state: TrainState, batches: dict[str, jax.Array]) -> tuple[TrainState, dict]:
        """Run ``K`` steps (asynchronously dispatched); metrics stay on device."""
        # The mesh in context lets the models pin activations' batch axis (sharding.constrain_batch).
        with self._traced():
            if (experience := self.experience) is not None:
                return self._experience_steps(experience, state, batches)
            return self._train_call(state, batches)

    def _experience_steps(
        self,
        experience: Callable[[Any, dict[str, Any], jax.Array, int], dict[str, Any]],
        state: TrainState,
        batches: dict[str, Any],
    ) -> tuple[TrainState, dict]:
        """``K`` steps one at a time, each on the batch the experience stage made with the weights of that step:
        a rollout needs the newest weights, so it waits for the step before it. The stage's key is a function of
        the seed and the step, so the batches (and a resumed run) are the same however the run was cut.

        A stage that samples ahead (``ahead`` k > 0: asynchronous GRPO, :mod:`functrain.tasks.grpo.ahead`) hands
        over the batch it made k steps earlier (``take``; None where its pipeline starts: made now), and once the
        step is dispatched makes the next ones with a copy of the step's weights (``make_ahead``): the host samples
        and scores while the devices train."""
        step = int(jax.device_get(state.step))
        stream = self.experience_stream
        assert stream is not None, "made with the experience stage"
        logged = getattr(experience, "logged", None)  # optional: values logged as they are (a running total)
        per_step, host_values = [], []
        for k in range(len(next(iter(batches.values())))):
            prompts = {name: value[k] for name, value in batches.items()}
            params = self._sampler_weights(state.params) if self.ahead else state.params
            batch = experience.take(step + k) if self.ahead else None  # type: ignore[attr-defined]
            if batch is None:
                batch = experience(params, prompts, jax.random.fold_in(stream, step + k), step + k)
            if logged is not None:
                host_values.append(logged(step + k))
            # This process's rows, a call of one step, placed as the loader's batches are.
            rows = self._global_calls({name: np.asarray(value)[None] for name, value in batch.items()})
            state, metrics = self._train_call(state, rows)
            if self.ahead:  # dispatched: sampled and scored while the step trains
                keys = partial(jax.random.fold_in, stream)
                experience.make_ahead(params, prompts, keys, step + k)  # type: ignore[attr-defined]
            per_step.append(metrics)
        # One step's metrics are [1] already: no concatenation to dispatch per metric.
        metrics = per_step[0] if len(per_step) == 1 else jax.tree.map(lambda *v: jnp.concatenate(v), *per_step)
        if host_values:  # float64 on the host, beside the device's metrics
            metrics = {
                **metrics,
                **{name: np.array([v[name] for v in host_values], np.float64) for name in host_values[0]},
            }
        return state, metrics

    def compile_train_call(
        self, state: TrainState, batches: dict[str, jax.Array], compiler_options: dict[str, Any] | None = None
    ) -> jax.stages.Compiled:
        """The train call compiled for these arguments (with XLA ``compiler_options``), for XLA's analyses
        (``memory_analysis``, ``cost_analysis``); running the call goes through :meth:`train_call`."""
        with self._traced():
            return self._train_call.lower(state, batches).compile(compiler_options=compiler_options)

    def abstract_train_args(
        self, example_batch: dict[str, np.ndarray], steps_per_call: int
    ) -> tuple[TrainState, dict[str, jax.ShapeDtypeStruct]]:
        """The train call's arguments as shapes with their shardings (the state, and ``steps_per_call`` batches
        shaped like ``example_batch``): :meth:`compile_train_call` of them plans a run without allocating it."""
        batches = {
            name: jax.ShapeDtypeStruct(
                (steps_per_call, *np.shape(value)), np.asarray(value).dtype, sharding=self.stacked_batch_sharding
            )
            for name, value in example_batch.items()
        }
        return _with_shardings(self.abstract_state, self.state_shardings), batches

    def eval_batch(self, state: TrainState, host_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Metric sums of one evaluation batch ``[B_local, ...]``."""
        batch = to_global(host_batch, self.batch_sharding, batch_axis=0)
        with self._traced():
            return self._eval_step(state, batch)

    def batch_function(
        self, fn: Callable[[Any, Any, dict[str, jax.Array]], dict[str, jax.Array]]
    ) -> Callable[[TrainState, dict[str, np.ndarray]], dict[str, np.ndarray]]:
        """``fn(params, model_state, batch) -> {field: [B]}`` compiled on the mesh: the returned function takes the
        state and a host batch ``[B_local, ...]`` and gives host arrays ``[B]`` of the whole global batch (every
        process gets all of them). The params are cast as the step's forward sees them (``train.compute_dtype``,
        products at ``train.matmul_precision``), so values computed here match the step's (a task's start hook:
        precomputed reference log-probs)."""
        compute_dtype = self._compute_dtype

        def on_state(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return fn(cast_floating(state.params, compute_dtype), state.model_state, batch)

        compiled = jax.jit(
            at_precision(on_state, self._precision),
            in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=NamedSharding(self.mesh, PartitionSpec()),
        )

        def run(state: TrainState, host_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            batch = to_global(host_batch, self.batch_sharding, batch_axis=0)
            with self._traced():
                return self.to_host(compiled(state, batch))

        return run

    def params_digest(self, state: TrainState) -> str:
        """A hex digest of the state's params computed on the devices: the same for the same values on any
        mesh or process count (integer sums), with no host copy of the weights."""
        with self._traced():
            sums = self.to_host(self._weight_sums(state.params))
        leaves = jax.tree_util.tree_flatten_with_path(state.params)[0]
        named = {jax.tree_util.keystr(path): leaf for path, leaf in leaves}
        record = {path: [str(leaf.dtype), list(leaf.shape), sums[path].tolist()] for path, leaf in named.items()}
        return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def hot_path() -> contextlib.AbstractContextManager:
        """No implicit device-to-host copy while steps are dispatched (a stray ``float()`` of a metric would
        make the host wait for every step); host batches still flow in."""
        return jax.transfer_guard_device_to_host("disallow")

    @staticmethod
    def add(totals: dict[str, jax.Array], sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Evaluation sums added on the device."""
        return jax.tree.map(jnp.add, totals, sums)

    @staticmethod
    def wait(tree: Any) -> None:
        """Block until the computation that produced ``tree`` is done, without copying anything to the host
        (its outputs are ready together, so one leaf is enough; an experience stage's host values are not its)."""
        next(leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)).block_until_ready()

    @staticmethod
    def to_host(tree: Any) -> Any:
        """Materialise device values as numpy (blocks until they are computed)."""
        return jax.tree.map(np.asarray, jax.device_get(tree))

    @staticmethod
    def any_process(flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over all processes: a SIGTERM seen by one host stops (and saves on) all of them,
        instead of one entering the collective save while another starts the next step."""
        return distributed.any_process(flags)

    @staticmethod
    def step_of(state: TrainState) -> int:
        """The state's step as a Python int (blocks)."""
        return int(jax.device_get(state.step))

    @staticmethod
    def nonfinite_steps_of(state: TrainState) -> int:
        """How many steps of the state's history were flagged non-finite (blocks)."""
        return int(jax.device_get(state.nonfinite_steps))

    def describe(self) -> str:
        """Mesh, shardings of the largest parameters and state bytes per device (startup log)."""
        return sharding.describe(self.abstract_state, self.state_shardings, self.mesh)
