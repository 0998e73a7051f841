"""Functional optimizers and learning-rate schedules for torch tensors, with optax semantics.

Every function returns new tensors and never writes into its inputs, so a step that skips an update can
keep the old state as it is. The arithmetic follows optax 0.2.8 operation by operation (float32, same
bias correction, same epsilon placement, same decay order), so a torch run tracks the JAX run step for
step. A schedule maps the optimizer's update count (an int32 0-dim tensor) to a float32 0-dim tensor;
it stays on the count's device, so reading the learning rate never waits for the accelerator.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from functrain.errors import ConfigError

Tensor = torch.Tensor
Params = dict[str, Tensor]
OptState = dict
Schedule = Callable[[Tensor], Tensor]


# --------------------------------------------------------------------------------------------- schedules

def _linear(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """optax.linear_schedule: interpolate over ``transition_steps``, then hold ``end_value``."""
    if transition_steps <= 0:
        return lambda count: torch.full(count.shape, init_value, dtype=torch.float32, device=count.device)

    def schedule(count: Tensor) -> Tensor:
        done = torch.clamp(count, 0, transition_steps).to(torch.float32)
        fraction = 1 - done / transition_steps
        return (init_value - end_value) * fraction + end_value
    return schedule


def _cosine(init_value: float, decay_steps: int, alpha: float) -> Schedule:
    """optax.cosine_decay_schedule (exponent 1): half a cosine from ``init_value`` to ``alpha * init``."""
    def schedule(count: Tensor) -> Tensor:
        progress = torch.clamp(count.to(torch.float32), max=float(decay_steps))
        cosine = 0.5 * (1 + torch.cos(math.pi * progress / float(decay_steps)))
        return init_value * ((1 - alpha) * cosine + alpha)
    return schedule


def _join(first: Schedule, second: Schedule, boundary: int) -> Schedule:
    """optax.join_schedules for two schedules: ``second`` restarts its count at ``boundary``."""
    def schedule(count: Tensor) -> Tensor:
        return torch.where(count < boundary, first(count), second(count - boundary))
    return schedule


def _tabulated(schedule: Schedule, length: int) -> Schedule:
    """``schedule`` precomputed for counts ``[0, length)``; later counts read the last entry.

    Every schedule here is constant after its last transition, so the table is exact, and a lookup is two
    tensor operations instead of a dozen (that difference shows on small models).
    """
    table = schedule(torch.arange(length, dtype=torch.int32))
    on_device: dict[torch.device, Tensor] = {}

    def lookup(count: Tensor) -> Tensor:
        values = on_device.get(count.device)
        if values is None:
            values = on_device.setdefault(count.device, table.to(count.device))
        return values[torch.clamp(count, 0, length - 1)]
    return lookup


def make_schedule(name: str, learning_rate: float, warmup_steps: int = 0, max_steps: int = 0,
                  end_lr_ratio: float = 0.0) -> Schedule:
    """The learning-rate schedule ``name`` ("constant", "cosine" or "linear") after a linear warmup from 0.

    Mirrors ``functrain.core.optim.make_schedule``: with ``decay = max(max_steps - warmup, 1)``, cosine is
    optax.warmup_cosine_decay_schedule(0, lr, warmup, warmup + decay, lr * end_lr_ratio); linear decays
    lr -> lr * end_lr_ratio over ``decay`` steps; constant holds lr. No warmup means no join.
    """
    end_value = learning_rate * end_lr_ratio
    decay_steps = max(max_steps - warmup_steps, 1)
    warmup = _linear(0.0, learning_rate, warmup_steps)
    if name == "cosine":
        alpha = 0.0 if learning_rate == 0.0 else end_value / learning_rate
        body = _cosine(learning_rate, decay_steps, alpha)
    elif name == "linear":
        body = _linear(learning_rate, end_value, decay_steps)
    elif name == "constant":
        body, decay_steps = _linear(learning_rate, learning_rate, 0), 0
    else:
        raise ConfigError(f"optimizer.schedule={name!r} is unknown; use constant, cosine or linear")
    schedule = _join(warmup, body, warmup_steps) if warmup_steps else body
    return _tabulated(schedule, warmup_steps + decay_steps + 1)


# --------------------------------------------------------------------------------------------- optimizers

@dataclass(frozen=True)
class Optimizer:
    """A functional optimizer: ``init(params) -> opt_state``, ``update(params, grads, opt_state,
    learning_rate=None) -> (new_params, new_opt_state)`` and ``learning_rate(opt_state)``, the rate the next
    update uses (``update`` computes it when not given; a step that reports it passes it in).

    ``opt_state`` is a dict of tensors with an int32 ``count`` of applied updates (the schedule's input).
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Params, OptState]]
    learning_rate: Callable[[OptState], Tensor]


def decay_mask(params: Params) -> dict[str, bool]:
    """Which parameters get weight decay: matrices and up (ndim >= 2), never biases or norm scales."""
    return {name: value.ndim >= 2 for name, value in params.items()}


def _zeros_like(params: Params) -> Params:
    return {name: torch.zeros_like(value) for name, value in params.items()}


def _count(params: Params) -> Tensor:
    device = next(iter(params.values())).device if params else "cpu"
    return torch.zeros((), dtype=torch.int32, device=device)


def _add_decayed_weights_(updates: list[Tensor], params: list[Tensor], mask: Iterable[bool],
                          weight_decay: float) -> None:
    """optax.add_decayed_weights, in place on freshly computed ``updates``: ``u += wd * p`` where masked."""
    if weight_decay == 0.0:  # optax skips a zero constant decay too
        return
    chosen = [(u, p) for u, p, decayed in zip(updates, params, mask) if decayed]
    if chosen:
        torch._foreach_add_([u for u, _ in chosen], [p for _, p in chosen], alpha=weight_decay)


def _apply(params: list[Tensor], updates: list[Tensor], learning_rate: Tensor) -> list[Tensor]:
    """optax.scale_by_learning_rate + apply_updates: ``p + (-lr) * u`` (``updates`` are scaled in place)."""
    torch._foreach_mul_(updates, -learning_rate)
    return torch._foreach_add(params, updates)


def adamw(schedule: Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 0.0) -> Optimizer:
    """optax.adamw(schedule, b1, b2, eps, weight_decay=..., mask=ndim >= 2) as a functional optimizer."""

    def init(params: Params) -> OptState:
        return {"count": _count(params), "mu": _zeros_like(params), "nu": _zeros_like(params)}

    def update(params: Params, grads: Params, opt_state: OptState,
               learning_rate: Tensor | None = None) -> tuple[Params, OptState]:
        names = list(params)
        p, g = [params[n] for n in names], [grads[n] for n in names]
        # Each result is allocated once and then finished in place: the inputs are never written.
        mu = torch._foreach_mul([opt_state["mu"][n] for n in names], b1)
        torch._foreach_add_(mu, g, alpha=1 - b1)                         # b1 * mu + (1 - b1) * g
        nu = torch._foreach_mul([opt_state["nu"][n] for n in names], b2)
        torch._foreach_addcmul_(nu, g, g, value=1 - b2)                  # b2 * nu + (1 - b2) * g^2
        count = opt_state["count"]
        next_count = count + 1
        # optax computes decay**count in float32 and divides the moments by (1 - that).
        exponent = next_count.to(torch.float32)
        denominator = torch._foreach_div(nu, 1 - torch.pow(b2, exponent))
        torch._foreach_sqrt_(denominator)
        torch._foreach_add_(denominator, eps)                            # sqrt(nu_hat) + eps
        steps = torch._foreach_div(mu, 1 - torch.pow(b1, exponent))
        torch._foreach_div_(steps, denominator)                          # mu_hat / (sqrt(nu_hat) + eps)
        _add_decayed_weights_(steps, p, decay_mask(params).values(), weight_decay)
        new_p = _apply(p, steps, schedule(count) if learning_rate is None else learning_rate)
        return dict(zip(names, new_p)), {"count": next_count, "mu": dict(zip(names, mu)),
                                          "nu": dict(zip(names, nu))}

    return Optimizer(init=init, update=update, learning_rate=lambda opt_state: schedule(opt_state["count"]))


def sgd(schedule: Schedule, momentum: float | None = None, nesterov: bool = False,
        weight_decay: float = 0.0) -> Optimizer:
    """optax.chain(add_decayed_weights(wd, mask=ndim >= 2), optax.sgd(schedule, momentum, nesterov)).

    ``momentum`` None or 0 is plain SGD (no trace in the state).
    """
    use_trace = bool(momentum)

    def init(params: Params) -> OptState:
        state = {"count": _count(params)}
        if use_trace:
            state["trace"] = _zeros_like(params)
        return state

    def update(params: Params, grads: Params, opt_state: OptState,
               learning_rate: Tensor | None = None) -> tuple[Params, OptState]:
        names = list(params)
        p = [params[n] for n in names]
        steps = [grads[n].clone() for n in names]  # fresh buffers: everything below works in place on them
        _add_decayed_weights_(steps, p, decay_mask(params).values(), weight_decay)
        new_state = {"count": opt_state["count"] + 1}
        if use_trace:
            # optax.trace: t' = g + m * t; nesterov applies the same rule once more to g and t'.
            trace = torch._foreach_mul([opt_state["trace"][n] for n in names], momentum)
            torch._foreach_add_(trace, steps)
            if nesterov:
                torch._foreach_add_(steps, torch._foreach_mul(trace, momentum))
            else:
                steps = [t.clone() for t in trace]
            new_state["trace"] = dict(zip(names, trace))
        new_p = _apply(p, steps, schedule(opt_state["count"]) if learning_rate is None else learning_rate)
        return dict(zip(names, new_p)), new_state

    return Optimizer(init=init, update=update, learning_rate=lambda opt_state: schedule(opt_state["count"]))


def make_optimizer(name: str, schedule: Schedule, *, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                   weight_decay: float = 0.0, momentum: float | None = None,
                   nesterov: bool = False) -> Optimizer:
    """The optimizer ``name`` ("adamw" or "sgd") driven by ``schedule``."""
    if name == "adamw":
        return adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if name == "sgd":
        return sgd(schedule, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    raise ConfigError(f"optimizer.name={name!r} is unknown; use adamw or sgd")


def from_settings(settings: Any) -> Optimizer:
    """The twin of ``functrain.core.optim.named_optimizer(settings)``; what torch cannot honour is refused."""
    schedule = settings.schedule
    driven = make_schedule(schedule.name, schedule.learning_rate, schedule.warmup_steps, schedule.total_steps,
                           schedule.end_lr_ratio)
    options = dict(settings.options)
    for key, value in options.items():
        if key in ("mu_dtype", "accumulator_dtype") and value is not None:
            raise ConfigError(f"optimizer.mu_dtype={value} is not implemented for backend: torch; remove it or set "
                              f"backend=jax")
    return make_optimizer(settings.name, driven, b1=options.get("b1", 0.9), b2=options.get("b2", 0.999),
                          eps=options.get("eps", 1e-8), weight_decay=settings.weight_decay,
                          momentum=options.get("momentum") or None, nesterov=options.get("nesterov", False))
