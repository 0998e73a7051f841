"""The pure torch training step: ``step(state, batch) -> (state, metrics)`` with JAX-step semantics.

Inputs are never written: gradients are taken with respect to detached views of the parameters, buffers
are cloned before the model may update them, and the optimizer returns new tensors. Micro-batching,
the global weight normalisation, clipping and the non-finite policy follow ``functrain.core.step`` exactly:

* a batch ``[B, ...]`` is split into ``M`` micro-batches as ``x.reshape(B//M, M, ...).swapaxes(0, 1)``,
  i.e. micro-batch ``m`` holds rows ``m, m+M, m+2M, ...``;
* gradient = sum over micro-batches (and processes) of grad(loss_sum), divided once by the total weight;
* ``grad_norm`` is the global L2 norm before clipping; clipping is optax.clip_by_global_norm;
* a non-finite loss or gradient norm leaves params, buffers and optimizer state as they were.

Randomness comes from a ``torch.Generator`` seeded from (seed, step, micro-batch, rank); the global
torch RNG is never used, so a resumed run draws the same numbers as an uninterrupted one.
"""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from functrain.errors import ConfigError, DataError
from torch_bridge import distributed
from torch_bridge.optim import Optimizer, Tensors

Tensor = torch.Tensor
Params = dict[str, Tensor]
Batch = Mapping[str, Tensor]
LossOutput = tuple[Tensor, Tensor, dict[str, Tensor]]
LossFn = Callable[[Params, Params, Batch, "torch.Generator | None"], LossOutput]


@dataclass(frozen=True)
class TorchState:
    """Immutable training state of the torch backend.

    Attributes:
      params: parameter name (torch dotted name) -> float32 tensor.
      buffers: buffer name -> tensor (e.g. batch statistics); ``{}`` when the model has none.
      opt_state: the optimizer's dict of tensors (see :mod:`torch_bridge.optim`).
      step: optimizer steps attempted (skipped steps count too, keeping data position and RNG in step).
      seed: the run seed; with ``step`` it determines every random number of the step.
      skipped_steps: int32 0-dim tensor, updates skipped because the loss or gradients were not finite.
    """

    params: Params
    buffers: Params
    opt_state: dict
    step: int
    seed: int
    skipped_steps: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.int32))

    @classmethod
    def create(
        cls,
        params: Params,
        optimizer: Optimizer,
        seed: int,
        buffers: Params | None = None,
    ) -> "TorchState":
        """A step-0 state with a fresh optimizer state for ``params``."""
        device = next(iter(params.values())).device
        return cls(
            params=dict(params),
            buffers=dict(buffers or {}),
            opt_state=optimizer.init(params),
            step=0,
            seed=int(seed),
            skipped_steps=torch.zeros((), dtype=torch.int32, device=device),
        )


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: spreads nearby integers over all 64 bits."""
    value = (value + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return value ^ (value >> 31)


def step_generator(
    seed: int, step: int, micro_batch: int = 0, rank: int = 0, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The generator of one micro-batch of one step: a pure function of its four integers."""
    mixed = 0
    for part in (seed, step, micro_batch, rank):
        mixed = _mix64(mixed ^ (part & 0xFFFFFFFFFFFFFFFF))
    return torch.Generator(device=device).manual_seed(mixed >> 1)  # manual_seed wants a non-negative int63


# Devices whose flags the host reads directly (free on CPU); elsewhere both branches run and torch.where picks.
HOST_BRANCH_DEVICES = ("cpu",)


def _choose(flag: Tensor, if_true: Callable[[], Any], if_false: Callable[[], Any]) -> Any:
    """``if_true()`` where ``flag`` else ``if_false()``, for trees of tensors.

    On CPU reading the flag costs nothing, so only the chosen branch runs; on an accelerator both run and
    ``torch.where`` selects, so the host never waits for the device.
    """
    if flag.device.type in HOST_BRANCH_DEVICES:
        return if_true() if bool(flag) else if_false()
    return _where_tree(flag, if_true(), if_false())


def _where_tree(flag: Tensor, a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _where_tree(flag, a[k], b[k]) for k in a}
    if isinstance(a, (list, tuple)):
        return type(a)(_where_tree(flag, x, y) for x, y in zip(a, b))
    return torch.where(flag, a, b)


def _function_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_loss_output(output: Any, loss_fn: Callable) -> LossOutput:
    """Validate ``(loss_sum, weight_sum, aux)``: two 0-dim tensors and a dict of 0-dim tensors."""
    name = _function_name(loss_fn)
    if not (isinstance(output, tuple) and len(output) == 3 and isinstance(output[2], dict)):
        raise ConfigError(
            f"loss function {name} must return (loss_sum, weight_sum, aux_dict); got {type(output).__name__}"
        )
    loss_sum, weight_sum, aux = output
    for what, value in [("loss_sum", loss_sum), ("weight_sum", weight_sum)] + [
        (f"aux[{key!r}]", value) for key, value in aux.items()
    ]:
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ConfigError(
                f"loss function {name} returned {what} with shape {shape}; it must be a 0-dim "
                f"tensor (sum over the batch, e.g. (per_example * weight).sum())"
            )
    return loss_sum, weight_sum, aux


def _check_untouched(params: Params, versions: list[int], loss_fn: Callable) -> None:
    """Raise if the model wrote into a parameter in place (its version counter moved)."""
    for (name, value), version in zip(params.items(), versions):
        if value._version != version:
            raise ConfigError(
                f"loss function {_function_name(loss_fn)} modified parameter {name!r} in place; "
                f"the step must stay pure: compute new tensors instead of in-place ops"
            )


def _micro_batch(batch: Batch, index: int, count: int) -> dict[str, Tensor]:
    """Rows ``index, index+count, ...``: the ``reshape(B//M, M).swapaxes(0, 1)`` split of the JAX step."""
    if count == 1:
        return dict(batch)
    return {key: value[index::count] for key, value in batch.items()}


def _global_norm(tensors: Tensors) -> Tensor:
    """optax.tree.norm: the L2 norm of all elements of all tensors (the norm of the per-tensor norms)."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors)))


def _weight_count(batch: Batch) -> int:
    return next(iter(batch.values())).shape[0]


def autocast(compute_dtype: torch.dtype | None, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's precision context: ``torch.autocast`` to ``compute_dtype`` (None: float32, no autocast).

    Parameters, gradients and the optimizer stay float32 (the master weights); autocast runs matmuls and
    convolutions in ``compute_dtype`` and keeps reductions such as the cross-entropy in float32.
    """
    if compute_dtype is None or compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=compute_dtype)


def make_train_step(
    loss_fn: LossFn,
    optimizer: Optimizer,
    *,
    micro_batches: int = 1,
    clip_norm: float | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Callable[[TorchState, Batch], tuple[TorchState, dict[str, Tensor]]]:
    """Build ``step(state, batch) -> (new_state, metrics)``.

    ``loss_fn(params, buffers, batch, generator) -> (loss_sum, weight_sum, aux)`` where ``aux`` holds scalar
    sums; it may update ``buffers`` in place (they are clones). ``compute_dtype`` (e.g. ``torch.bfloat16``)
    runs the loss under :func:`autocast`; parameters stay float32. Metrics (0-dim tensors): loss, weight,
    grad_norm, learning_rate (the rate this update used), skipped_steps, nonfinite (1 when this step's
    loss or gradient was not finite: the update was skipped; with ``train.nonfinite: stop`` the loop stops),
    and each aux entry divided by the total weight.
    """
    if micro_batches < 1:
        raise ConfigError(f"train.micro_batches={micro_batches} must be >= 1")

    def gradient_sums(state: TorchState, batch: Batch) -> tuple[Tensor, Tensor, dict, Tensors, Params]:
        """Loss, weight, aux and gradient summed over the local micro-batches; the updated buffers."""
        names = list(state.params)
        buffers = {key: value.clone() for key, value in state.buffers.items()}
        device = next(iter(state.params.values())).device
        rank = distributed.rank()
        loss_sum: Tensor | None = None
        weight_sum: Tensor | None = None
        grads: Tensors | None = None
        aux_sums: dict[str, Tensor] = {}
        for index in range(micro_batches):
            leaves = {name: value.detach().requires_grad_() for name, value in state.params.items()}
            generator = step_generator(state.seed, state.step, index, rank, device)
            with torch.enable_grad(), autocast(compute_dtype, device):
                output = loss_fn(leaves, buffers, _micro_batch(batch, index, micro_batches), generator)
            loss, weight, aux = _check_loss_output(output, loss_fn)
            leaf_list = [leaves[name] for name in names]
            unused_as_none = (
                torch.autograd.grad(loss, leaf_list, allow_unused=True) if loss.requires_grad else [None] * len(names)
            )
            micro_grads = [torch.zeros_like(p) if g is None else g for g, p in zip(unused_as_none, leaf_list)]
            loss, weight = loss.detach(), weight.detach()
            if loss_sum is None or weight_sum is None or grads is None:  # the first micro-batch
                loss_sum, weight_sum, grads = loss, weight, list(micro_grads)
                aux_sums = {key: value.detach() for key, value in aux.items()}
            else:
                loss_sum, weight_sum = loss_sum + loss, weight_sum + weight
                grads = torch._foreach_add(grads, micro_grads)
                aux_sums = {key: aux_sums[key] + value.detach() for key, value in aux.items()}
        assert loss_sum is not None and weight_sum is not None and grads is not None, "micro_batches >= 1"
        return loss_sum, weight_sum, aux_sums, grads, buffers

    def step(state: TorchState, batch: Batch) -> tuple[TorchState, dict[str, Tensor]]:
        rows = _weight_count(batch)
        if rows % micro_batches:
            raise DataError(
                f"batch of {rows} rows does not split into train.micro_batches={micro_batches}; "
                f"make the per-process batch a multiple of it"
            )
        names = list(state.params)
        versions = [value._version for value in state.params.values()]
        loss_sum, weight_sum, aux_sums, grads, buffers = gradient_sums(state, batch)
        _check_untouched(state.params, versions, loss_fn)

        aux_keys = list(aux_sums)
        reduced = distributed.all_reduce_sum([loss_sum, weight_sum, *aux_sums.values(), *grads])
        loss_sum, weight_sum = reduced[0], reduced[1]
        aux_sums = dict(zip(aux_keys, reduced[2 : 2 + len(aux_keys)]))
        # One division by the global weight; max() keeps an all-padding batch from dividing by zero.
        denominator = torch.clamp(weight_sum, min=1e-12)
        grads = torch._foreach_div(reduced[2 + len(aux_keys) :], denominator)

        loss = loss_sum / denominator
        grad_norm = _global_norm(grads)
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if clip_norm is not None:
            # optax.clip_by_global_norm's rule, written as the JAX step writes it; the gradients are this
            # step's own fresh tensors, so scaling them in place is invisible outside.
            # min(1, c / norm) equals the JAX step's where(norm < c, 1, c / norm), NaN and 0 included.
            torch._foreach_mul_(grads, torch.clamp(clip_norm / grad_norm, max=1.0))
        learning_rate = optimizer.learning_rate(state.opt_state)

        def updated() -> tuple[Params, Params, dict]:
            new_params, new_opt_state = optimizer.update(
                state.params, dict(zip(names, grads)), state.opt_state, learning_rate
            )
            return new_params, buffers, new_opt_state

        params, buffers, opt_state = _choose(finite, updated, lambda: (state.params, state.buffers, state.opt_state))
        nonfinite_step = (~finite).to(torch.int32)
        skipped = state.skipped_steps + nonfinite_step
        metrics = {
            "loss": loss,
            "weight": weight_sum,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate,
            "skipped_steps": skipped,
            "nonfinite": nonfinite_step,
            "nonfinite_steps": skipped,
        }  # float32 without loss scaling: every skip is an incident
        metrics.update({key: value / denominator for key, value in aux_sums.items()})
        new_state = TorchState(
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            step=state.step + 1,
            seed=state.seed,
            skipped_steps=skipped,
        )
        return new_state, metrics

    return step


def make_eval_step(
    loss_fn: LossFn,
    compute_dtype: torch.dtype | None = None,
) -> Callable[[TorchState, Batch], dict[str, Tensor]]:
    """Build ``eval_step(state, batch) -> {"loss": sum, "weight": sum, **aux sums}`` over all processes.

    The loss function gets ``generator=None``: no randomness (e.g. no dropout) in evaluation. It runs under
    :func:`autocast` to ``compute_dtype`` as the training step does.
    """

    def eval_step(state: TorchState, batch: Batch) -> dict[str, Tensor]:
        buffers = {key: value.clone() for key, value in state.buffers.items()}
        device = next(iter(state.params.values())).device
        with torch.no_grad(), autocast(compute_dtype, device):
            loss_sum, weight_sum, aux = _check_loss_output(loss_fn(state.params, buffers, dict(batch), None), loss_fn)
        sums = {"loss": loss_sum, "weight": weight_sum, **aux}
        return dict(zip(sums, distributed.all_reduce_sum(list(sums.values()))))

    return eval_step
