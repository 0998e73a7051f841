"""torch_bridge.optim agrees with optax: schedules value by value, optimizers update by update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from functrain.errors import ConfigError
from functrain.core.optim import make_schedule as jax_schedule
from torch_bridge.optim import adamw, make_schedule, sgd

LR, WARMUP, MAX_STEPS, END = 0.1, 5, 30, 0.1


@pytest.mark.parametrize("name", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("warmup,max_steps", [(WARMUP, MAX_STEPS), (0, MAX_STEPS), (5, 3)])
def test_schedules_match_the_jax_side(name, warmup, max_steps):
    ours = make_schedule(name, LR, warmup, max_steps, END)
    theirs = jax_schedule(name, LR, warmup, max_steps, END)
    counts = np.arange(0, MAX_STEPS + 10)
    got = np.array([float(ours(torch.tensor(c, dtype=torch.int32))) for c in counts])
    want = np.array([float(theirs(jnp.asarray(c, jnp.int32))) for c in counts])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    assert got[warmup] == pytest.approx(LR)


def test_unknown_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="optimizer.schedule"):
        make_schedule("exponential", LR)


def _run_both(ours, theirs, steps: int = 25):
    """Apply the same gradient sequence with both; return the two final parameter dicts."""
    rng = np.random.default_rng(0)
    init = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    t_params = {k: torch.tensor(v) for k, v in init.items()}
    j_params = {k: jnp.asarray(v) for k, v in init.items()}
    t_state, j_state = ours.init(t_params), theirs.init(j_params)
    for _ in range(steps):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()}
        old_params, copies = t_params, {k: v.clone() for k, v in t_params.items()}
        t_params, t_state = ours.update(t_params, {k: torch.tensor(v) for k, v in grads.items()}, t_state)
        for k in copies:  # functional: the previous parameters are untouched
            assert torch.equal(old_params[k], copies[k]) and t_params[k] is not old_params[k]
        updates, j_state = theirs.update({k: jnp.asarray(v) for k, v in grads.items()}, j_state, j_params)
        j_params = optax.apply_updates(j_params, updates)
    return t_params, j_params


def _mask(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def test_adamw_matches_optax():
    schedule = make_schedule("cosine", 0.05, 3, 25, 0.1)
    optax_schedule = optax.warmup_cosine_decay_schedule(0.0, 0.05, 3, decay_steps=25, end_value=0.005)
    ours = adamw(schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3)
    theirs = optax.adamw(optax_schedule, b1=0.8, b2=0.95, eps=1e-6, weight_decay=0.3, mask=_mask)
    t_params, j_params = _run_both(ours, theirs)
    for k in t_params:
        np.testing.assert_allclose(t_params[k].numpy(), np.asarray(j_params[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum,nesterov", [(None, False), (0.9, False), (0.9, True)])
def test_sgd_matches_optax(momentum, nesterov):
    schedule = make_schedule("linear", 0.05, 2, 25, 0.0)
    optax_schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, 0.05, 2), optax.linear_schedule(0.05, 0.0, 23)], [2])
    ours = sgd(schedule, momentum=momentum, nesterov=nesterov, weight_decay=0.1)
    theirs = optax.chain(optax.add_decayed_weights(0.1, _mask),
                         optax.sgd(optax_schedule, momentum=momentum, nesterov=nesterov))
    t_params, j_params = _run_both(ours, theirs)
    for k in t_params:
        np.testing.assert_allclose(t_params[k].numpy(), np.asarray(j_params[k]), rtol=1e-5, atol=1e-6)
