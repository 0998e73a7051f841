"""Optimizers and learning-rate schedules from the ``optimizer`` config section, and user optimizers.

Names: ``adamw``, ``sgd``, ``adafactor``, ``lion`` and ``muon`` (when the installed optax has
``optax.contrib.muon``). Each reads the keys in :data:`OPTIMIZER_KEYS` (mapped to optax's argument names;
``mu_dtype`` is the dtype of the first moment / momentum buffer, e.g. float32 beside bfloat16 parameters);
for adafactor, lion and muon a key left at its config default takes optax's own default instead.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from functrain.config import PYTHON_OBJECT
from functrain.errors import ConfigError


def make_schedule(name: str, learning_rate: float, warmup_steps: int, total_steps: int,
                  end_lr_ratio: float) -> optax.Schedule:
    """Linear warmup from 0, then ``constant``, ``cosine`` or ``linear`` decay to ``lr * end_lr_ratio``."""
    end_lr = learning_rate * end_lr_ratio
    decay_steps = max(total_steps - warmup_steps, 1)
    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, learning_rate, warmup_steps,
                                                  warmup_steps + decay_steps, end_lr)
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


# Optimizer name -> {config key: optax argument}; weight_decay (masked to matrices) applies to all.
OPTIMIZER_KEYS: dict[str, dict[str, str]] = {
    "adamw": {"b1": "b1", "b2": "b2", "eps": "eps", "mu_dtype": "mu_dtype"},
    "sgd": {"momentum": "momentum", "nesterov": "nesterov", "mu_dtype": "accumulator_dtype"},
    "adafactor": {"momentum": "momentum", "eps": "eps", "mu_dtype": "dtype_momentum"},
    "lion": {"b1": "b1", "b2": "b2", "mu_dtype": "mu_dtype"},
    "muon": {"momentum": "beta", "nesterov": "nesterov", "eps": "eps", "b1": "adam_b1", "b2": "adam_b2",
             "mu_dtype": "mu_dtype"},
}
if not hasattr(optax.contrib, "muon"):  # older optax
    del OPTIMIZER_KEYS["muon"]


def _set_keys(config: Any, name: str) -> dict[str, Any]:
    """The optax keyword arguments of ``name`` whose config value differs from the field's default."""
    fields = type(config).model_fields
    return {argument: _optax_value(key, getattr(config, key)) for key, argument in OPTIMIZER_KEYS[name].items()
            if getattr(config, key) != fields[key].default}


def _optax_value(key: str, value: Any) -> Any:
    """A config value as optax takes it: dtype names as dtypes."""
    return jnp.dtype(value) if key == "mu_dtype" and value is not None else value


def named_optimizer(config: Any, schedule: optax.Schedule) -> optax.GradientTransformation:
    """The optax transformation named by ``config.name``, driven by ``schedule``."""
    name, decay = config.name, config.weight_decay
    mu_dtype = _optax_value("mu_dtype", config.mu_dtype)
    if name == "adamw":
        return optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=decay,
                           mask=decay_mask, mu_dtype=mu_dtype)
    if name == "sgd":
        return optax.chain(optax.add_decayed_weights(decay, mask=decay_mask),
                           optax.sgd(schedule, momentum=config.momentum or None, nesterov=config.nesterov,
                                     accumulator_dtype=mu_dtype))
    if name == "adafactor":
        return optax.adafactor(schedule, weight_decay_rate=decay or None, weight_decay_mask=decay_mask,
                               **_set_keys(config, name))
    if name == "lion":
        return optax.lion(schedule, weight_decay=decay, mask=decay_mask, **_set_keys(config, name))
    if name == "muon" and name in OPTIMIZER_KEYS:
        return optax.contrib.muon(schedule, weight_decay=decay, weight_decay_mask=decay_mask,
                                  **_set_keys(config, name))
    if name == PYTHON_OBJECT:
        raise ConfigError("optimizer.name=python_object records an optimizer passed to fit; pass it again with "
                          "fit(..., optimizer=) or set optimizer.name or optimizer.target")
    raise ConfigError(f"unknown optimizer.name {name!r}; choose one of {', '.join(sorted(OPTIMIZER_KEYS))}")


def resolve_optimizer(optimizer: Any, schedule: optax.Schedule, what: str = "optimizer"
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
        raise ConfigError(f"{what} returned {type(built).__name__} from the schedule, not an "
                          f"optax.GradientTransformation; return e.g. optax.adamw(schedule)")
    raise ConfigError(f"{what} is a {type(optimizer).__name__}, not an optax.GradientTransformation or a function "
                      f"of the schedule returning one; pass e.g. optax.adamw(1e-3) or lambda lr: optax.adamw(lr)")


def config_schedule(config: Any, total_steps: int) -> optax.Schedule:
    """The learning-rate schedule of an ``optimizer`` config section."""
    return make_schedule(config.schedule, config.learning_rate, config.warmup_steps, total_steps,
                         config.end_lr_ratio)


def make_optimizer(config: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation and its schedule for an ``optimizer`` config section."""
    schedule = config_schedule(config, total_steps)
    return named_optimizer(config, schedule), schedule
