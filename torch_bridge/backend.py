"""The torch backend of the loop (``backend: torch``): same methods as ``functrain.run.jax_backend.JaxBackend``.

The loop stays framework-agnostic: it hands this object numpy host batches ``[K, B_local, ...]`` and
checkpoint items, and gets states and metric tensors back. Checkpoints have the JAX backend's items and
run-directory layout with numpy leaves (so ``inspect`` and ``--digest`` work unchanged), but the parameters
keep the torch module's names and shapes: ``params`` is a nested dict from the torch dotted names split on
"." (the loop refuses to resume a run written by the other backend). ``state`` holds step,
opt_state, rng (``[0, seed]`` as uint32, the raw layout of ``PRNGKey(seed)``), model_state (buffers),
loss_scale, good_steps and skipped_steps. Tensors live on CUDA when it is available, else on the CPU.
Data parallelism is torch.distributed (joined from torchrun-style env vars): ``process_index`` and
``process_count`` tell the loop which rows of each global batch this process loads.

The model is the config's torch twin (``model.name`` mlp or gpt) or any ``nn.Module`` passed in, trained
with its own parameter and buffer names and a user loss or the built-in loss that fits the data (see
:mod:`torch_bridge.user_model`). ``train.compute_dtype: bfloat16`` runs the forward under autocast with
float32 master parameters; ``train.torch_compile: true`` runs a user module's training forward through
``torch.compile`` (see :func:`torch_bridge.user_model.compiled`).
"""

import contextlib
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np
import torch

from functrain.core.step import StepSettings
from functrain.errors import CheckpointError, ConfigError
from torch_bridge import distributed
from torch_bridge.models import flatten
from torch_bridge.optim import Optimizer
from torch_bridge.step import LossFn, TorchState, make_eval_step, make_train_step

Tensor = torch.Tensor


def nest(flat: Mapping[str, Any]) -> dict:
    """``{"a.b": x}`` -> ``{"a": {"b": x}}`` (torch dotted names to the checkpoint's nested dicts)."""
    tree: dict = {}
    for name, value in flat.items():
        *parents, leaf = name.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _map_tree(fn, tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {key: _map_tree(fn, value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_tree(fn, value) for value in tree)
    return fn(tree)


def _to_numpy(value: Any) -> Any:
    """A tensor as numpy; bfloat16 (which torch cannot hand to numpy) as ml_dtypes' bfloat16, bit for bit."""
    if not isinstance(value, Tensor):
        return np.asarray(value)
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def _to_tensor(value: Any, dtype: torch.dtype, device: torch.device) -> Tensor:
    """numpy -> a tensor of ``dtype`` on ``device`` (bfloat16 arrays are reinterpreted, bit for bit)."""
    value = np.asarray(value)
    if value.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(value.view(np.int16).copy()).view(torch.bfloat16).to(device=device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=device)


# train.compute_dtype -> the autocast dtype (float16 would need loss scaling, which the torch step lacks).
COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
PROBE_ROWS = 2  # rows of the example batch the loss is tried on before training starts


class TorchBackend:
    """Model, optimizer and pure steps of one torch run: the :class:`~functrain.core.backend.Backend` of torch.

    Built from pieces the builder resolved (:func:`functrain.run.backends.torch_backend`): the module (the config's
    twin or the user's, see :func:`torch_bridge.user_model.trainable_module`), the step's loss
    (:func:`torch_bridge.user_model.step_loss`), the twin optimizer (:func:`torch_bridge.optim.from_settings`),
    the step settings and the seed. ``probe_batch``: user code is tried on its first rows here, so it fails in
    one line before a run directory is touched, not at step 1.
    """

    name = "torch"

    def __init__(
        self,
        model: torch.nn.Module,
        loss: LossFn,
        optimizer: Optimizer,
        *,
        step: StepSettings,
        seed: int,
        probe_batch: Mapping[str, np.ndarray] | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        distributed.init_from_env()
        if step.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(
                f"train.compute_dtype={step.compute_dtype} is not supported with backend: torch; "
                f"use train.compute_dtype=bfloat16 or float32"
            )
        self.seed = seed
        self.device = torch.device(
            device or (f"cuda:{distributed.local_rank()}" if torch.cuda.is_available() else "cpu")
        )
        # On CPU a call has finished when it returns; on CUDA it is queued until its metrics are read.
        self.synchronous = self.device.type == "cpu"
        self.process_index, self.process_count = distributed.rank(), distributed.world_size()
        self.writes_checkpoints = self.process_index == 0  # ranks hold replicas: rank 0 writes alone
        self.devices: list[Any] = []  # MFU is reported for JAX devices only
        self.model = model.to(self.device)  # in place: the loss keeps its hold on the module's tensors
        self.optimizer = optimizer
        compute_dtype = COMPUTE_DTYPES[step.compute_dtype]
        self._step = make_train_step(
            loss,
            self.optimizer,
            micro_batches=step.micro_batches,
            clip_norm=step.clip_norm,
            compute_dtype=compute_dtype,
        )
        self._eval_step = make_eval_step(loss, compute_dtype)
        if probe_batch is not None:
            self._eval_step(self.init_state(), self.place({k: v[:PROBE_ROWS] for k, v in probe_batch.items()}))

    # ------------------------------------------------------------------------------------------ state

    def init_state(self) -> TorchState:
        """A fresh step-0 state: the model's initial weights (as float32 masters) and a fresh optimizer state."""
        params = {name: value.detach().to(self.device, torch.float32) for name, value in self.model.named_parameters()}
        buffers = {name: value.detach().to(self.device) for name, value in self.model.named_buffers()}
        return TorchState.create(params, self.optimizer, self.seed, buffers)

    def _abstract(self, state: TorchState) -> dict[str, Any]:
        return _map_tree(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.state_to_items(state))

    def restore_targets(self) -> dict[str, Any]:
        """Checkpoint items as shape/dtype structs without shardings: they restore as numpy arrays."""
        return self._abstract(self.init_state())

    def state_to_items(self, state: TorchState) -> dict[str, Any]:
        """The checkpoint items of ``state`` as nested dicts of numpy arrays."""
        seed = state.seed & 0xFFFFFFFFFFFFFFFF
        rest = {
            "step": np.asarray(state.step, np.int32),
            "opt_state": _map_tree(_to_numpy, self._nest_opt_state(state.opt_state)),
            "rng": np.asarray([seed >> 32, seed & 0xFFFFFFFF], np.uint32),
            "model_state": nest({k: _to_numpy(v) for k, v in state.buffers.items()}),
            "loss_scale": np.asarray(1.0, np.float32),
            "good_steps": np.asarray(0, np.int32),
            "skipped_steps": np.asarray(_to_numpy(state.skipped_steps), np.int32),
            "nonfinite_steps": np.asarray(_to_numpy(state.skipped_steps), np.int32),
        }
        return {"params": nest({k: _to_numpy(v) for k, v in state.params.items()}), "state": rest}

    @staticmethod
    def _nest_opt_state(opt_state: dict) -> dict:
        return {key: nest(value) if isinstance(value, dict) else value for key, value in opt_state.items()}

    def _tensors(self, flat: Mapping[str, Any], expected: Mapping[str, Tensor], what: str) -> dict[str, Tensor]:
        """numpy leaves -> tensors on this device, with the expected names, shapes and dtypes."""
        missing, unexpected = sorted(set(expected) - set(flat)), sorted(set(flat) - set(expected))
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {what} do not match the torch model: missing {missing[:6]}, unexpected "
                f"{unexpected[:6]}; restore a checkpoint written for this model (backend: torch) or convert it"
            )
        tensors = {}
        for name, reference in expected.items():
            value = np.asarray(flat[name])
            if tuple(value.shape) != tuple(reference.shape):
                raise CheckpointError(
                    f"checkpoint {what} {name!r} has shape {tuple(value.shape)}, the model "
                    f"expects {tuple(reference.shape)}; use the model config it was saved with"
                )
            tensors[name] = _to_tensor(value, reference.dtype, self.device)
        return tensors

    def state_from_items(self, items: Mapping[str, Any], fresh: TorchState | None = None) -> TorchState:
        """Rebuild a state from restored items; without a ``state`` item the optimizer starts fresh.

        ``fresh`` (default: a new initial state) gives the dtypes and devices the tensors are placed with.
        """
        fresh = fresh if fresh is not None else self.init_state()
        params = self._tensors(flatten(items["params"]), fresh.params, "params")
        saved = items.get("state")
        if saved is None:
            return TorchState.create(params, self.optimizer, fresh.seed, fresh.buffers)
        opt_state: dict[str, Tensor | dict[str, Tensor]] = {}
        for key, value in fresh.opt_state.items():
            if isinstance(value, dict):
                opt_state[key] = self._tensors(flatten(saved["opt_state"][key]), value, f"opt_state/{key}")
            else:
                opt_state[key] = _to_tensor(saved["opt_state"][key], value.dtype, self.device)
        buffers = self._tensors(flatten(saved.get("model_state") or {}), fresh.buffers, "model_state")
        high, low = (int(x) for x in np.asarray(saved["rng"], np.uint64))
        return TorchState(
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            step=int(saved["step"]),
            seed=(high << 32) | low,
            skipped_steps=torch.tensor(int(saved["skipped_steps"]), dtype=torch.int32, device=self.device),
        )

    @staticmethod
    def step_of(state: TorchState) -> int:
        """The state's step as a Python int."""
        return state.step

    @staticmethod
    def nonfinite_steps_of(state: TorchState) -> int:
        """Steps flagged non-finite so far (float32 without loss scaling: every skipped step)."""
        return int(state.skipped_steps)

    # ------------------------------------------------------------------------------------------ steps

    def place(self, host_batches: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """numpy host batches -> tensors on this backend's device (no copy on CPU when possible)."""

        def to_tensor(array: np.ndarray) -> Tensor:
            array = np.asarray(array)
            if not (array.flags.writeable and array.flags.c_contiguous):
                array = np.array(array)  # torch.from_numpy needs a writable, contiguous buffer
            return torch.from_numpy(array).to(self.device, non_blocking=True)

        return {key: to_tensor(value) for key, value in host_batches.items()}

    def train_call(self, state: TorchState, batches: Mapping[str, Any]) -> tuple[TorchState, dict[str, Tensor]]:
        """Run ``K`` steps on batches ``[K, B_local, ...]`` (numpy or placed); metrics come back ``[K]``."""
        if any(isinstance(value, np.ndarray) for value in batches.values()):
            batches = self.place(batches)
        steps = next(iter(batches.values())).shape[0]
        per_step = []
        for index in range(steps):
            state, metrics = self._step(state, {key: value[index] for key, value in batches.items()})
            per_step.append(metrics)
        return state, {key: torch.stack([m[key] for m in per_step]) for key in per_step[0]}

    def eval_batch(self, state: TorchState, host_batch: Mapping[str, np.ndarray]) -> dict[str, Tensor]:
        """Metric sums (over all processes) of one evaluation batch ``[B_local, ...]``."""
        return self._eval_step(state, self.place(host_batch))

    @staticmethod
    def hot_path() -> contextlib.AbstractContextManager:
        """Nothing to guard: torch has no implicit device-to-host copies to forbid."""
        return contextlib.nullcontext()

    @staticmethod
    def add(totals: dict[str, Tensor], sums: dict[str, Tensor]) -> dict[str, Tensor]:
        """Evaluation sums added on the device."""
        return {name: totals[name] + sums[name] for name in totals}

    @staticmethod
    def to_host(tree: Any) -> Any:
        """Tensors -> numpy, anywhere in a tree of dicts, lists and tuples (waits for the device)."""
        return _map_tree(_to_numpy, tree)

    def wait(self, tree: Any) -> None:
        """Block until queued work is done (CUDA runs asynchronously; the CPU has finished already)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def any_process(flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks, so all ranks stop or save together."""
        return distributed.any_process(flags)

    def describe(self) -> str:
        """One startup line: torch version, device, parameter count, processes."""
        count = sum(p.numel() for p in self.model.parameters())
        return (
            f"torch {torch.__version__} on {self.device}, {type(self.model).__name__} with {count:,} "
            f"parameters, {self.process_count} process(es)"
        )
