"""torch_bridge.optim agrees with optax: schedules value by value, optimizers update by update."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from functrain.errors import ConfigError
from functrain.core.optim import OptimizerSettings, ScheduleSettings, named_optimizer
from functrain.core.optim import make_schedule as jax_schedule
from torch_bridge.optim import adamw, from_settings, make_schedule, sgd

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


def _run_both(ours, theirs, steps: int = 25, jit: bool = False):
    """Apply the same gradient sequence with both; return the two final parameter dicts (and, with ``jit``,
    optax's update jitted as the JAX step runs it, the two final optimizer states)."""
    rng = np.random.default_rng(0)
    init = {"w": rng.normal(size=(4, 3)).astype(np.float32), "b": rng.normal(size=(3,)).astype(np.float32)}
    t_params = {k: torch.tensor(v) for k, v in init.items()}
    j_params = {k: jnp.asarray(v) for k, v in init.items()}
    t_state, j_state = ours.init(t_params), theirs.init(j_params)
    update = jax.jit(theirs.update) if jit else theirs.update
    for _ in range(steps):
        grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in init.items()}
        old_params, copies = t_params, {k: v.clone() for k, v in t_params.items()}
        t_params, t_state = ours.update(t_params, {k: torch.tensor(v) for k, v in grads.items()}, t_state)
        for k in copies:  # functional: the previous parameters are untouched
            assert torch.equal(old_params[k], copies[k]) and t_params[k] is not old_params[k]
        updates, j_state = update({k: jnp.asarray(v) for k, v in grads.items()}, j_state, j_params)
        j_params = optax.apply_updates(j_params, updates)
    return (t_params, j_params, t_state, j_state) if jit else (t_params, j_params)


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


def _settings(name: str, weight_decay: float = 0.1, **options) -> OptimizerSettings:
    return OptimizerSettings(name, ScheduleSettings("cosine", 0.05, 3, 25, 0.1), weight_decay, options)


def _assert_states_match(t_state, j_state):
    """Every moment of the torch state equals optax's, in optax's dtype."""
    j_leaves = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(j_state)}
    for key in ("mu", "nu", "trace"):
        for name, value in t_state.get(key, {}).items():
            [(path, theirs)] = [(p, v) for p, v in j_leaves.items() if p.endswith(f"{key}['{name}']")]
            assert str(value.dtype).removeprefix("torch.") == str(theirs.dtype), path
            np.testing.assert_allclose(value.float().numpy(), np.asarray(theirs, np.float32), rtol=1e-5, atol=1e-7,
                                       err_msg=path)


@pytest.mark.parametrize("settings", [
    _settings("lion", b1=0.8, b2=0.95),
    _settings("lion", weight_decay=0.0),
    _settings("lion", b1=0.9, b2=0.99, mu_dtype="bfloat16"),
    _settings("adamw", b1=0.8, b2=0.95, eps=1e-6, mu_dtype="bfloat16"),
    _settings("adamw", b1=0.9, b2=0.999, eps=1e-8, mu_dtype="float32"),
    _settings("sgd", momentum=0.9, nesterov=False, accumulator_dtype="bfloat16"),
    _settings("sgd", momentum=0.9, nesterov=True, accumulator_dtype="bfloat16"),
    _settings("sgd", momentum=0.0, nesterov=False, accumulator_dtype=None),
], ids=lambda s: f"{s.name}-{'-'.join(f'{k}={v}' for k, v in s.options.items())}")
def test_from_settings_matches_named_optimizer(settings):
    """The same settings through both factories: same parameters and the same stored moments (dtype
    included) after 25 updates, optax jitted as the JAX step runs it."""
    ours, theirs = from_settings(settings), named_optimizer(settings)
    t_params, j_params, t_state, j_state = _run_both(ours, theirs, jit=True)
    for k in t_params:
        np.testing.assert_allclose(t_params[k].numpy(), np.asarray(j_params[k]), rtol=1e-5, atol=1e-6)
    _assert_states_match(t_state, j_state)


@pytest.mark.parametrize("name,options,key", [
    ("adafactor", {}, "optimizer.name=adafactor"),
    ("muon", {}, "optimizer.name=muon"),
    ("adamw", {"nesterov": True}, "optimizer.nesterov"),
    ("lion", {"eps": 1e-8}, "optimizer.eps"),
    ("adamw", {"mu_dtype": "int8"}, "optimizer.mu_dtype"),
    ("sgd", {"momentum": 0.9, "accumulator_dtype": "float64x"}, "optimizer.mu_dtype"),
])
def test_from_settings_refuses_what_torch_cannot_honour(name, options, key):
    with pytest.raises(ConfigError, match=re.escape(key)) as error:
        from_settings(_settings(name, **options))
    assert "\n" not in str(error.value)
