"""Optimizers and learning-rate schedules as plain factories, and user optimizers.

Names: ``adamw``, ``sgd``, ``adafactor``, ``lion`` and ``muon`` (when the installed optax has
``optax.contrib.muon``), built from :class:`OptimizerSettings` (name, schedule, weight decay, optax keyword
arguments). Reading them from a config is the builder's job (:mod:`functrain.run.build`); the torch bridge
builds its twin optimizers from the same settings.
"""

from dataclasses import dataclass, field
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from functrain.errors import ConfigError


def make_schedule(
    name: str, learning_rate: float, warmup_steps: int, total_steps: int, end_lr_ratio: float
) -> optax.Schedule:
    """Linear warmup from 0, then ``constant``, ``cosine`` or ``linear`` decay to ``lr * end_lr_ratio``."""
    end_lr = learning_rate * end_lr_ratio
    decay_steps = max(total_steps - warmup_steps, 1)
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps, warmup_steps + decay_steps, end_lr)
    if name == "linear":
        after_warmup = optax.linear_schedule(learning_rate, end_lr, decay_steps)
    elif name == "constant":
        after_warmup = optax.constant_schedule(learning_rate)
    else:
        raise ValueError(f"unknown schedule {name!r}")
    if warmup_steps == 0:
        return after_warmup
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after_warmup], [warmup_steps])


def decay_mask(params: Any) -> Any:
    """Weight decay applies to matrices and embeddings only, not to biases and norm scales."""
    return jax.tree.map(lambda p: jnp.ndim(p) >= 2, params)


@dataclass(frozen=True)
class ScheduleSettings:
    """A learning-rate schedule by name: linear warmup from 0, then ``constant``, ``cosine`` or ``linear``."""

    name: str
    learning_rate: float
    warmup_steps: int
    total_steps: int
    end_lr_ratio: float = 0.0

    def optax(self) -> optax.Schedule:
        """The schedule as an optax function of the update count."""
        return make_schedule(self.name, self.learning_rate, self.warmup_steps, self.total_steps, self.end_lr_ratio)


@dataclass(frozen=True)
class OptimizerSettings:
    """An optimizer by name, as both backends build it: ``options`` are optax's keyword arguments of that
    optimizer (``b1``, ``eps``, ``mu_dtype`` as a dtype name, ...); weight decay is masked to matrices."""

    name: str
    schedule: ScheduleSettings
    weight_decay: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)


# The optimizers named_optimizer builds (muon only where the installed optax has optax.contrib.muon).
OPTIMIZER_NAMES = ("adamw", "sgd", "adafactor", "lion") + (("muon",) if hasattr(optax.contrib, "muon") else ())
DTYPE_OPTIONS = ("mu_dtype", "accumulator_dtype", "dtype_momentum")


def named_optimizer(
    settings: OptimizerSettings, schedule: optax.Schedule | None = None
) -> optax.GradientTransformation:
    """The optax transformation ``settings`` name, driven by ``schedule`` (default: the settings' own)."""
    schedule = schedule if schedule is not None else settings.schedule.optax()
    decay = settings.weight_decay
    options = {
        key: jnp.dtype(value) if key in DTYPE_OPTIONS and value is not None else value
        for key, value in settings.options.items()
    }
    name = settings.name
    if name == "adamw":
        return optax.adamw(schedule, weight_decay=decay, mask=decay_mask, **options)
    if name == "sgd":
        options["momentum"] = options.get("momentum") or None  # 0: plain SGD, no trace in the state
        return optax.chain(optax.add_decayed_weights(decay, mask=decay_mask), optax.sgd(schedule, **options))
    if name == "adafactor":
        return optax.adafactor(schedule, weight_decay_rate=decay or None, weight_decay_mask=decay_mask, **options)
    if name == "lion":
        return optax.lion(schedule, weight_decay=decay, mask=decay_mask, **options)
    if name == "muon" and name in OPTIMIZER_NAMES:
        return optax.contrib.muon(schedule, weight_decay=decay, weight_decay_mask=decay_mask, **options)
    raise ConfigError(f"unknown optimizer.name {name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")


def as_transformation(
    optimizer: Any, schedule: optax.Schedule, what: str = "optimizer"
) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """A user optimizer as ``(transformation, reported schedule)``.

    ``optimizer`` is an ``optax.GradientTransformation`` (its learning rate is its own business: none is
    reported) or a function of the schedule returning one (``lambda lr: optax.adamw(lr)``), which is then
    driven and reported by the config's schedule. Anything else is a one-line ConfigError naming ``what``.
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer, None
    if callable(optimizer):
        built = optimizer(schedule)
        if isinstance(built, optax.GradientTransformation):
            return built, schedule
        raise ConfigError(
            f"{what} returned {type(built).__name__} from the schedule, not an "
            f"optax.GradientTransformation; return e.g. optax.adamw(schedule)"
        )
    raise ConfigError(
        f"{what} is a {type(optimizer).__name__}, not an optax.GradientTransformation or a function "
        f"of the schedule returning one; pass e.g. optax.adamw(1e-3) or lambda lr: optax.adamw(lr)"
    )
