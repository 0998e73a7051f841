"""Optimizers and learning-rate schedules from the ``optimizer`` config section."""

from typing import Any

import jax
import jax.numpy as jnp
import optax


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


def make_optimizer(config: Any, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optax transformation and its schedule for an ``optimizer`` config section."""
    schedule = make_schedule(config.schedule, config.learning_rate, config.warmup_steps, total_steps,
                             config.end_lr_ratio)
    if config.name == "adamw":
        tx = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                         weight_decay=config.weight_decay, mask=decay_mask)
    elif config.name == "sgd":
        tx = optax.chain(optax.add_decayed_weights(config.weight_decay, mask=decay_mask),
                         optax.sgd(schedule, momentum=config.momentum or None, nesterov=config.nesterov))
    else:
        raise ValueError(f"unknown optimizer {config.name!r}")
    return tx, schedule

