"""Functional optimizers and learning-rate schedules for torch tensors, with optax semantics.

Every function returns new tensors and never writes into its inputs, so a step that skips an update can
keep the old state as it is. The arithmetic follows optax 0.2.8 operation by operation (float32, same
bias correction, same epsilon placement, same decay order), so a torch run tracks the JAX run step for
step. A moment kept in a lower precision (``mu_dtype``) is stored in that dtype and read as optax's jitted
update reads it (see :func:`_decayed`). :func:`from_settings` builds the optimizer that
``functrain.core.optim.OptimizerSettings`` name, or refuses what torch cannot honour. A schedule maps the
optimizer's update count (an int32 0-dim tensor) to a float32 0-dim tensor; it stays on the count's device,
so reading the learning rate never waits for the accelerator.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from functrain.core.optim import OptimizerSettings
from functrain.errors import ConfigError

Tensor = torch.Tensor
Params = dict[str, Tensor]
OptState = dict
Tensors = list[Tensor] | tuple[Tensor, ...]  # torch's foreach functions take either and return tuples
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


def make_schedule(
    name: str, learning_rate: float, warmup_steps: int = 0, max_steps: int = 0, end_lr_ratio: float = 0.0
) -> Schedule:
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


def _zeros_like(params: Params, dtype: torch.dtype | None = None) -> Params:
    return {name: torch.zeros_like(value, dtype=dtype) for name, value in params.items()}


def _decayed(moments: Tensors, decay: float) -> Tensors:
    """``decay * m`` as optax's jitted update computes it for a moment stored in any dtype.

    jnp turns the Python ``decay`` into the moment's dtype (bfloat16(0.9) is 0.8984375), and XLA (allowed
    excess precision) multiplies in float32 without rounding the product back: so round the constant, not
    the product. For float32 moments this is the plain product.
    """
    if all(m.dtype == torch.float32 for m in moments):
        return torch._foreach_mul(moments, decay)
    return [m.to(torch.float32) * torch.tensor(decay, dtype=m.dtype).item() for m in moments]


def _update_moment(grads: Tensors, moments: Tensors, decay: float, order: int = 1) -> Tensors:
    """optax.tree.update_moment: ``(1 - decay) * g**order + decay * m``, in float32 (not yet cast back)."""
    updated = _decayed(moments, decay)
    if order == 1:
        torch._foreach_add_(updated, grads, alpha=1 - decay)
    else:
        torch._foreach_addcmul_(updated, grads, grads, value=1 - decay)
    return updated


def _cast(tensors: Tensors, dtype: torch.dtype | None) -> Tensors:
    """optax.tree.cast: the moments as stored (``dtype`` None keeps them as computed)."""
    return tensors if dtype is None else [t.to(dtype) for t in tensors]


def _count(params: Params) -> Tensor:
    device = next(iter(params.values())).device if params else "cpu"
    return torch.zeros((), dtype=torch.int32, device=device)


def _add_decayed_weights_(updates: Tensors, params: Tensors, mask: Iterable[bool], weight_decay: float) -> None:
    """optax.add_decayed_weights, in place on freshly computed ``updates``: ``u += wd * p`` where masked."""
    if weight_decay == 0.0:  # optax skips a zero constant decay too
        return
    chosen = [(u, p) for u, p, decayed in zip(updates, params, mask) if decayed]
    if chosen:
        torch._foreach_add_([u for u, _ in chosen], [p for _, p in chosen], alpha=weight_decay)


def _apply(params: Tensors, updates: Tensors, learning_rate: Tensor) -> Tensors:
    """optax.scale_by_learning_rate + apply_updates: ``p + (-lr) * u`` (``updates`` are scaled in place)."""
    torch._foreach_mul_(updates, -learning_rate)
    return torch._foreach_add(params, updates)


def adamw(
    schedule: Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> Optimizer:
    """optax.adamw(schedule, b1, b2, eps, mu_dtype, weight_decay=..., mask=ndim >= 2) as a functional optimizer.

    With ``mu_dtype`` the first moment is stored in that dtype; the update itself uses the float32 moment
    before the cast (as optax does).
    """

    def init(params: Params) -> OptState:
        return {"count": _count(params), "mu": _zeros_like(params, mu_dtype), "nu": _zeros_like(params)}

    def update(
        params: Params, grads: Params, opt_state: OptState, learning_rate: Tensor | None = None
    ) -> tuple[Params, OptState]:
        names = list(params)
        p, g = [params[n] for n in names], [grads[n] for n in names]
        # Each result is allocated once and then finished in place: the inputs are never written.
        mu = _update_moment(g, [opt_state["mu"][n] for n in names], b1)
        nu = _update_moment(g, [opt_state["nu"][n] for n in names], b2, order=2)
        count = opt_state["count"]
        next_count = count + 1
        # optax computes decay**count in float32 and divides the moments by (1 - that).
        exponent = next_count.to(torch.float32)
        denominator = torch._foreach_div(nu, 1 - torch.pow(b2, exponent))
        torch._foreach_sqrt_(denominator)
        torch._foreach_add_(denominator, eps)  # sqrt(nu_hat) + eps
        steps = torch._foreach_div(mu, 1 - torch.pow(b1, exponent))
        torch._foreach_div_(steps, denominator)  # mu_hat / (sqrt(nu_hat) + eps)
        _add_decayed_weights_(steps, p, decay_mask(params).values(), weight_decay)
        new_p = _apply(p, steps, schedule(count) if learning_rate is None else learning_rate)
        return dict(zip(names, new_p)), {
            "count": next_count,
            "mu": dict(zip(names, _cast(mu, mu_dtype))),
            "nu": dict(zip(names, nu)),
        }

    return Optimizer(init=init, update=update, learning_rate=lambda opt_state: schedule(opt_state["count"]))


def sgd(
    schedule: Schedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    accumulator_dtype: torch.dtype | None = None,
) -> Optimizer:
    """optax.chain(add_decayed_weights(wd, mask=ndim >= 2), optax.sgd(schedule, momentum, nesterov,
    accumulator_dtype)).

    ``momentum`` None or 0 is plain SGD (no trace in the state); ``accumulator_dtype`` is the trace's
    stored dtype (the update uses the trace before the cast, as optax does).
    """

    def init(params: Params) -> OptState:
        state: OptState = {"count": _count(params)}
        if momentum:
            state["trace"] = _zeros_like(params, accumulator_dtype)
        return state

    def update(
        params: Params, grads: Params, opt_state: OptState, learning_rate: Tensor | None = None
    ) -> tuple[Params, OptState]:
        names = list(params)
        p = [params[n] for n in names]
        steps = [grads[n].clone() for n in names]  # fresh buffers: everything below works in place on them
        _add_decayed_weights_(steps, p, decay_mask(params).values(), weight_decay)
        new_state = {"count": opt_state["count"] + 1}
        if momentum:
            # optax.trace: t' = g + m * t; nesterov applies the same rule once more to g and t'.
            trace = _decayed([opt_state["trace"][n] for n in names], momentum)
            torch._foreach_add_(trace, steps)
            if nesterov:
                torch._foreach_add_(steps, torch._foreach_mul(trace, momentum))
            else:
                steps = [t.clone() for t in trace]
            new_state["trace"] = dict(zip(names, _cast(trace, accumulator_dtype)))
        new_p = _apply(p, steps, schedule(opt_state["count"]) if learning_rate is None else learning_rate)
        return dict(zip(names, new_p)), new_state

    return Optimizer(init=init, update=update, learning_rate=lambda opt_state: schedule(opt_state["count"]))


def lion(
    schedule: Schedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> Optimizer:
    """optax.lion(schedule, b1, b2, mu_dtype, weight_decay=..., mask=ndim >= 2) as a functional optimizer.

    The update is ``sign((1 - b1) * g + b1 * mu)`` plus the masked decay, scaled by ``-lr``; the momentum
    then becomes ``(1 - b2) * g + b2 * mu``, stored in ``mu_dtype``. The weight decay is the settings' own
    (optax's default of 1e-3 applies only to callers that leave it out, which functrain never does).
    """

    def init(params: Params) -> OptState:
        return {"count": _count(params), "mu": _zeros_like(params, mu_dtype)}

    def update(
        params: Params, grads: Params, opt_state: OptState, learning_rate: Tensor | None = None
    ) -> tuple[Params, OptState]:
        names = list(params)
        p, g = [params[n] for n in names], [grads[n] for n in names]
        mu = [opt_state["mu"][n] for n in names]
        steps = _update_moment(g, mu, b1)
        torch._foreach_sign_(steps)
        _add_decayed_weights_(steps, p, decay_mask(params).values(), weight_decay)
        count = opt_state["count"]
        new_p = _apply(p, steps, schedule(count) if learning_rate is None else learning_rate)
        new_mu = _cast(_update_moment(g, mu, b2), mu_dtype)
        return dict(zip(names, new_p)), {"count": count + 1, "mu": dict(zip(names, new_mu))}

    return Optimizer(init=init, update=update, learning_rate=lambda opt_state: schedule(opt_state["count"]))


def make_optimizer(
    name: str,
    schedule: Schedule,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    momentum: float | None = None,
    nesterov: bool = False,
) -> Optimizer:
    """The optimizer ``name`` ("adamw" or "sgd") driven by ``schedule``."""
    if name == "adamw":
        return adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if name == "sgd":
        return sgd(schedule, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
    raise ConfigError(f"optimizer.name={name!r} is unknown; use adamw or sgd")


# The optax keyword arguments each optimizer honours on torch; a dtype option holds a dtype name.
TORCH_OPTIONS = {
    "adamw": ("b1", "b2", "eps", "mu_dtype"),
    "sgd": ("momentum", "nesterov", "accumulator_dtype"),
    "lion": ("b1", "b2", "mu_dtype"),
}
DTYPE_OPTIONS = ("mu_dtype", "accumulator_dtype")
# The config key an optax argument comes from, where the names differ (functrain.config.sections.OPTIMIZER_KEYS).
CONFIG_KEYS = {"accumulator_dtype": "mu_dtype"}
FACTORIES: dict[str, Callable[..., Optimizer]] = {"adamw": adamw, "sgd": sgd, "lion": lion}


def _dtype(key: str, value: Any) -> torch.dtype | None:
    """A dtype option's name (``"bfloat16"``) as a torch floating dtype; None stays None."""
    if value is None:
        return None
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(
            f"optimizer.{CONFIG_KEYS.get(key, key)}={value!r} is not a floating dtype torch has; "
            f"use float32 or bfloat16"
        )
    return dtype


def _options(settings: OptimizerSettings) -> dict[str, Any]:
    """The settings' optax options as this module's keyword arguments, refusing any torch cannot honour."""
    name = settings.name
    if name not in FACTORIES:
        raise ConfigError(
            f"optimizer.name={name} is not implemented for backend: torch; use adamw, sgd or lion, or backend: jax"
        )
    options = {}
    for key, value in settings.options.items():
        if key not in TORCH_OPTIONS[name]:
            raise ConfigError(
                f"optimizer.{CONFIG_KEYS.get(key, key)} (optax {key}) is not implemented for "
                f"optimizer.name={name} on backend: torch; remove it or use backend: jax"
            )
        options[key] = _dtype(key, value) if key in DTYPE_OPTIONS else value
    if name == "sgd":
        options["momentum"] = options.get("momentum") or None  # 0: plain SGD, no trace (as on the JAX side)
    return options


def from_settings(settings: OptimizerSettings) -> Optimizer:
    """The torch twin of ``functrain.core.optim.named_optimizer(settings)``: same name, schedule, masked
    weight decay and optax options (``mu_dtype``/``accumulator_dtype`` as dtype names).

    A name or option torch cannot honour (adafactor, muon, an option the optax function takes but this
    module does not) is a one-line ConfigError naming the key and the fix.
    """
    options = _options(settings)
    s = settings.schedule
    schedule = make_schedule(s.name, s.learning_rate, s.warmup_steps, s.total_steps, s.end_lr_ratio)
    return FACTORIES[settings.name](schedule, weight_decay=settings.weight_decay, **options)
