"""The pure step: purity, exact accumulation, clipping, non-finite policy, precision, multi-step calls."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.conftest import max_abs_diff
from functrain import TrainState, make_eval_step, make_train_call, make_train_step
from functrain.core.precision import update_loss_scale

VOCAB, SEQ, DIM = 11, 9, 8


def init_params(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {"embed": jax.random.normal(k1, (VOCAB, DIM)) * 0.3, "out": jax.random.normal(k2, (DIM, VOCAB)) * 0.3}


def token_loss(params, batch, rng):
    """Per-token cross-entropy summed over unmasked tokens: a ragged-padding LM loss."""
    hidden = params["embed"][batch["tokens"]]
    logits = hidden @ params["out"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["mask"]
    return jnp.sum(losses * mask), jnp.sum(mask), {"tokens": jnp.sum(mask)}


def ragged_batch(batch_size: int, seed: int) -> dict:
    """Every sequence has a different number of real tokens (the rest is padding)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, SEQ + 1, size=batch_size)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.float32)
    return {"tokens": rng.integers(0, VOCAB, (batch_size, SEQ)).astype(np.int32),
            "targets": rng.integers(0, VOCAB, (batch_size, SEQ)).astype(np.int32), "mask": mask}


def fresh_state(tx, seed: int = 0) -> TrainState:
    return TrainState.create(init_params(seed), tx, jax.random.PRNGKey(42))


def run_steps(step_fn, state, batches):
    step_fn = jax.jit(step_fn)
    for batch in batches:
        state, metrics = step_fn(state, batch)
    return state, metrics


def test_step_is_pure_same_inputs_same_outputs_inputs_untouched():
    tx = optax.adamw(1e-2)
    state = fresh_state(tx)
    batch = ragged_batch(8, 0)
    before = jax.tree.map(np.array, state)
    batch_before = {k: v.copy() for k, v in batch.items()}
    step = jax.jit(make_train_step(token_loss, tx, micro_batches=2, clip_norm=1.0))
    s1, m1 = step(state, batch)
    s2, m2 = step(state, batch)
    assert max_abs_diff(s1.params, s2.params) == 0.0
    assert float(m1["loss"]) == float(m2["loss"])
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state)):
        np.testing.assert_array_equal(a, np.asarray(b))
    for key in batch:
        np.testing.assert_array_equal(batch[key], batch_before[key])
    assert int(s1.step) == 1 and int(state.step) == 0
    assert max_abs_diff(s1.params, state.params) > 0  # it did update something


def test_four_micro_batches_of_8_equal_one_batch_of_32_with_ragged_padding():
    tx = optax.adamw(5e-2, weight_decay=0.01)
    batches = [ragged_batch(32, seed) for seed in range(5)]
    whole, whole_metrics = run_steps(make_train_step(token_loss, tx), fresh_state(tx), batches)
    micro, micro_metrics = run_steps(make_train_step(token_loss, tx, micro_batches=4), fresh_state(tx), batches)
    assert max_abs_diff(whole.params, micro.params) <= 1e-6
    np.testing.assert_allclose(whole_metrics["loss"], micro_metrics["loss"], rtol=1e-6)
    assert float(micro_metrics["weight"]) == float(batches[-1]["mask"].sum())


def test_mean_of_means_would_differ_so_the_equivalence_test_has_teeth():
    """Dividing per micro-batch (the bug) gives a measurably different gradient on this data."""
    params = init_params()
    batch = ragged_batch(32, 1)
    grad_sum = jax.grad(lambda p: token_loss(p, batch, None)[0])(params)
    exact = jax.tree.map(lambda g: g / batch["mask"].sum(), grad_sum)
    chunks = [{k: v[i::4] for k, v in batch.items()} for i in range(4)]
    mean_of_means = jax.tree.map(lambda *gs: sum(gs) / 4, *[
        jax.tree.map(lambda g, c=c: g / c["mask"].sum(), jax.grad(lambda p, c=c: token_loss(p, c, None)[0])(params))
        for c in chunks])
    assert max_abs_diff(exact, mean_of_means) > 1e-4


def test_steps_per_call_8_is_bitwise_equal_to_steps_per_call_1():
    tx = optax.adamw(1e-2)
    step = make_train_step(token_loss, tx, micro_batches=2, clip_norm=0.5)
    batches = [ragged_batch(8, seed) for seed in range(8)]
    one_by_one = jax.jit(make_train_call(step))
    state = fresh_state(tx)
    losses_single = []
    for batch in batches:
        state, metrics = one_by_one(state, jax.tree.map(lambda x: x[None], batch))
        losses_single.append(float(metrics["loss"][0]))
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
    state8, metrics8 = jax.jit(make_train_call(step))(fresh_state(tx), stacked)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state8)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert losses_single == [float(x) for x in metrics8["loss"]]


def test_clipping_caps_the_update_and_reports_the_unclipped_norm():
    tx = optax.sgd(1.0)
    batch = ragged_batch(8, 3)
    state = fresh_state(tx)
    clipped, metrics = jax.jit(make_train_step(token_loss, tx, clip_norm=0.01))(state, batch)
    unclipped, metrics_free = jax.jit(make_train_step(token_loss, tx))(state, batch)
    assert float(metrics["grad_norm"]) == pytest.approx(float(metrics_free["grad_norm"]), rel=1e-6)
    assert float(metrics["grad_norm"]) > 0.01
    update = jax.tree.map(lambda a, b: a - b, clipped.params, state.params)
    assert float(optax.tree.norm(update)) == pytest.approx(0.01, rel=1e-4)
    assert float(optax.tree.norm(jax.tree.map(lambda a, b: a - b, unclipped.params, state.params))) > 0.02


def nan_on_flag_loss(params, batch, rng):
    loss_sum, weight, aux = token_loss(params, batch, rng)
    return jnp.where(batch["poison"][0] > 0, jnp.nan, loss_sum), weight, aux


def test_nonfinite_loss_never_reaches_params():
    tx = optax.adam(1e-2)
    step = jax.jit(make_train_step(nan_on_flag_loss, tx))
    good = {**ragged_batch(4, 0), "poison": np.zeros(4, np.float32)}
    bad = {**good, "poison": np.ones(4, np.float32)}
    state, _ = step(fresh_state(tx), good)
    after_bad, metrics = step(state, bad)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(after_bad.params))
    assert max_abs_diff(after_bad.params, state.params) == 0.0
    assert max_abs_diff(after_bad.opt_state, state.opt_state) == 0.0
    assert int(after_bad.skipped_steps) == 1 and int(metrics["skipped_steps"]) == 1
    assert int(metrics["nonfinite"]) == 1
    assert int(after_bad.step) == 2  # the step counter (data position, RNG) still advances
    resumed, metrics = step(after_bad, good)
    assert int(metrics["nonfinite"]) == 0 and max_abs_diff(resumed.params, after_bad.params) > 0


def test_bfloat16_compute_keeps_float32_params_and_tracks_float32_loss():
    tx = optax.adam(1e-2)
    batch = ragged_batch(8, 2)
    full, m32 = jax.jit(make_train_step(token_loss, tx))(fresh_state(tx), batch)
    half, m16 = jax.jit(make_train_step(token_loss, tx, compute_dtype=jnp.bfloat16))(fresh_state(tx), batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(half.params))
    assert float(m16["loss"]) == pytest.approx(float(m32["loss"]), rel=2e-2)
    assert float(m16["loss"]) != float(m32["loss"])  # it really computed in bfloat16


def test_dynamic_loss_scale_halves_on_overflow_and_skips_the_update():
    tx = optax.adam(1e-2)
    state = TrainState.create(init_params(), tx, jax.random.PRNGKey(0), loss_scale=2.0 ** 15)

    def overflowing_loss(params, batch, rng):
        loss_sum, weight, aux = token_loss(params, batch, rng)
        return loss_sum * 1e36, weight, aux  # float32 gradients overflow once scaled

    step = jax.jit(make_train_step(overflowing_loss, tx, dynamic_loss_scale=True))
    new_state, metrics = step(state, ragged_batch(4, 0))
    assert float(new_state.loss_scale) == 2.0 ** 14
    assert int(new_state.skipped_steps) == 1
    assert max_abs_diff(new_state.params, state.params) == 0.0
    scale, good = update_loss_scale(jnp.float32(8.0), jnp.int32(1999), jnp.bool_(True))
    assert float(scale) == 16.0 and int(good) == 0


def test_eval_step_returns_sums_that_add_up_across_batches():
    tx = optax.adam(1e-2)
    state = fresh_state(tx)
    batch = ragged_batch(16, 5)
    eval_step = jax.jit(make_eval_step(token_loss))
    whole = eval_step(state, batch)
    halves = [eval_step(state, {k: v[i::2] for k, v in batch.items()}) for i in range(2)]
    assert float(whole["weight"]) == float(batch["mask"].sum())
    assert float(whole["loss"]) == pytest.approx(sum(float(h["loss"]) for h in halves), rel=1e-6)


def test_step_keys_depend_only_on_the_step():
    state = fresh_state(optax.sgd(0.1))
    later = state.replace(step=jnp.int32(7))
    np.testing.assert_array_equal(later.step_key(), jax.random.fold_in(state.rng, 7))


def counting_loss(params, model_state, batch, rng):
    """A stateful loss: model_state counts the examples seen (like batch statistics would track them)."""
    loss_sum, weight, aux = token_loss(params, batch, rng)
    seen = model_state["seen"] + batch["tokens"].shape[0]
    return loss_sum, weight, aux, {"seen": seen}


def test_model_state_threads_through_micro_batches_and_survives_a_skipped_step():
    tx = optax.adam(1e-2)
    state = TrainState.create(init_params(), tx, jax.random.PRNGKey(0), model_state={"seen": jnp.int32(0)})
    step = jax.jit(make_train_step(counting_loss, tx, micro_batches=4, stateful=True))
    state, _ = step(state, ragged_batch(8, 0))
    assert int(state.model_state["seen"]) == 8  # 4 micro-batches of 2, each updating the carried state

    def poisoned(params, model_state, batch, rng):
        loss_sum, weight, aux, new_state = counting_loss(params, model_state, batch, rng)
        return loss_sum * jnp.nan, weight, aux, new_state

    skipped, metrics = jax.jit(make_train_step(poisoned, tx, stateful=True))(state, ragged_batch(8, 1))
    assert int(metrics["nonfinite"]) == 1 and int(skipped.model_state["seen"]) == 8
