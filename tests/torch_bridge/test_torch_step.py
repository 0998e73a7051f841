"""The torch step tracks the JAX step, stays pure, and rejects impure models and malformed losses."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn

from functrain.run.parts import make_optimizer as jax_make_optimizer
from functrain.core import step as jax_step
from functrain.config.sections import OptimizerConfig
from functrain.errors import ConfigError
from functrain.models.mlp import MLPConfig, build as build_flax_mlp
from functrain.core.state import TrainState
from functrain.core.losses import classifier_loss as flax_classifier_loss
from torch_bridge import TorchState, make_eval_step, make_optimizer, make_schedule, make_train_step
from torch_bridge.models import MLP, classifier_loss, params_from_flax
from torch_bridge.twins import twin_model

STEPS, BATCH, MICRO = 50, 64, 4
OPT = OptimizerConfig(name="adamw", learning_rate=3e-3, weight_decay=0.1, b1=0.9, b2=0.99, eps=1e-8,
                      schedule="cosine", warmup_steps=5, end_lr_ratio=0.1)


def _digits_batches(steps: int, batch: int) -> list[dict[str, np.ndarray]]:
    from sklearn.datasets import load_digits
    digits = load_digits()
    x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(steps):
        rows = rng.choice(len(y), batch, replace=False)
        weight = np.ones(batch, np.float32)
        weight[-3:] = 0.0  # padding rows must not count
        batches.append({"x": x[rows], "y": y[rows], "weight": weight})
    return batches


def _torch_batch(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


def test_torch_step_matches_jax_step_for_50_steps():
    batches = _digits_batches(STEPS, BATCH)
    flax_model = build_flax_mlp(MLPConfig(hidden=[64, 32]))
    flax_params = nn.meta.unbox(flax_model.init(jax.random.PRNGKey(1), batches[0]["x"])["params"])
    tx, schedule = jax_make_optimizer(OPT, STEPS)
    jstep = jax.jit(jax_step.make_train_step(flax_classifier_loss(flax_model, True), tx, micro_batches=MICRO,
                                             clip_norm=0.5, learning_rate_fn=schedule))
    jstate = TrainState.create(flax_params, tx, jax.random.PRNGKey(0))

    model = MLP(64, [64, 32], 10)
    optimizer = make_optimizer("adamw", make_schedule("cosine", 3e-3, 5, STEPS, 0.1), b1=0.9, b2=0.99,
                               eps=1e-8, weight_decay=0.1)
    tstep = make_train_step(classifier_loss(model), optimizer, micro_batches=MICRO, clip_norm=0.5)
    tstate = TorchState.create(params_from_flax(flax_params), optimizer, seed=0)

    clipped = 0
    for batch in batches:
        jstate, jm = jstep(jstate, {k: jnp.asarray(v) for k, v in batch.items()})
        tstate, tm = tstep(tstate, _torch_batch(batch))
        for key in ("loss", "weight", "grad_norm", "learning_rate", "accuracy"):
            np.testing.assert_allclose(float(tm[key]), float(jm[key]), rtol=1e-5, atol=1e-6, err_msg=key)
        clipped += float(jm["grad_norm"]) > 0.5
    assert clipped > 10 and tstate.step == STEPS  # clipping was exercised
    final = params_from_flax(jax.device_get(jstate.params))
    for name, value in tstate.params.items():
        np.testing.assert_allclose(value.numpy(), final[name].numpy(), rtol=1e-4, atol=1e-5, err_msg=name)


def _small_setup(**step_kwargs):
    model = MLP(64, [16], 10)
    model.reset_parameters(torch.Generator().manual_seed(0))
    optimizer = make_optimizer("adamw", make_schedule("constant", 1e-2), weight_decay=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = TorchState.create(params, optimizer, seed=3)
    return model, optimizer, state, make_train_step(classifier_loss(model), optimizer, **step_kwargs)


def test_step_is_pure_and_deterministic():
    _, _, state, step = _small_setup(micro_batches=2, clip_norm=1.0)
    batch = _torch_batch(_digits_batches(1, 32)[0])
    batch_copy = {k: v.clone() for k, v in batch.items()}
    snapshot = {k: v.clone() for k, v in state.params.items()}
    moments = {k: v.clone() for k, v in state.opt_state["mu"].items()}
    new_state, metrics = step(state, batch)
    again, metrics_again = step(state, batch)
    for k in snapshot:  # the inputs are exactly as they were
        assert torch.equal(state.params[k], snapshot[k]) and torch.equal(state.opt_state["mu"][k], moments[k])
        assert not torch.equal(new_state.params[k], snapshot[k]) or k.endswith("bias")
        assert torch.equal(new_state.params[k], again.params[k])  # same inputs, same outputs, bit for bit
    assert all(torch.equal(batch[k], batch_copy[k]) for k in batch)
    assert state.step == 0 and new_state.step == 1 and int(new_state.opt_state["count"]) == 1
    assert float(metrics["loss"]) == float(metrics_again["loss"])


def test_nonfinite_step_is_skipped():
    _, _, state, step = _small_setup()
    batch = _torch_batch(_digits_batches(1, 16)[0])
    batch["x"][0, 0] = float("nan")
    new_state, metrics = step(state, batch)
    assert int(metrics["nonfinite"]) == 1 and int(metrics["skipped_steps"]) == 1
    assert new_state.step == 1 and int(new_state.skipped_steps) == 1
    assert new_state.params is state.params and new_state.opt_state is state.opt_state
    good, metrics = step(new_state, _torch_batch(_digits_batches(1, 16)[0]))
    assert int(metrics["nonfinite"]) == 0 and int(good.opt_state["count"]) == 1 and good.step == 2


def test_device_path_selects_like_the_host_path(monkeypatch):
    """On an accelerator the step never reads a flag on the host: torch.where must give the same states."""
    import torch_bridge.step as step_module
    batches = [_torch_batch(b) for b in _digits_batches(3, 16)]
    batches[1]["x"][0, 0] = float("inf")  # the middle step is skipped
    runs = []
    for host_devices in (("cpu",), ()):
        monkeypatch.setattr(step_module, "HOST_BRANCH_DEVICES", host_devices)
        _, _, state, step = _small_setup(clip_norm=0.01, micro_batches=2)
        history = []
        for batch in batches:
            state, metrics = step(state, batch)
            history.append({k: v.clone() for k, v in metrics.items()})
        runs.append((state, history))
    (host_state, host_history), (device_state, device_history) = runs
    assert int(device_state.skipped_steps) == 1 and int(device_state.opt_state["count"]) == 2
    for name in host_state.params:
        assert torch.equal(host_state.params[name], device_state.params[name])
        assert torch.equal(host_state.opt_state["nu"][name], device_state.opt_state["nu"][name])
    for host, device in zip(host_history, device_history):
        assert all(torch.equal(host[k], device[k]) or not torch.isfinite(host[k]) for k in host)


def test_generator_is_a_function_of_seed_step_and_micro_batch():
    from torch_bridge import step_generator
    draw = lambda *args: torch.rand(4, generator=step_generator(*args))  # noqa: E731
    assert torch.equal(draw(1, 5, 0), draw(1, 5, 0))
    assert not torch.equal(draw(1, 5, 0), draw(1, 6, 0)) and not torch.equal(draw(1, 5, 0), draw(1, 5, 1))
    assert not torch.equal(draw(1, 5, 0), draw(2, 5, 0))


def test_model_that_writes_its_parameters_in_place_is_rejected():
    class Mutating(MLP):
        def forward(self, x, generator=None):
            with torch.no_grad():
                self.head.bias.add_(1.0)  # e.g. a hand-rolled weight normalisation
            return super().forward(x, generator)

    model = Mutating(64, [16], 10)
    optimizer = make_optimizer("sgd", make_schedule("constant", 0.1))
    state = TorchState.create({k: v.detach() for k, v in model.named_parameters()}, optimizer, seed=0)
    step = make_train_step(classifier_loss(model), optimizer)
    with pytest.raises(ConfigError, match="modified parameter 'head.bias' in place"):
        step(state, _torch_batch(_digits_batches(1, 8)[0]))


def test_loss_with_the_wrong_shape_is_rejected_by_name():
    model = MLP(64, [16], 10)

    def per_example_loss(params, buffers, batch, generator):
        logits = torch.func.functional_call(model, params, (batch["x"],))
        losses = torch.nn.functional.cross_entropy(logits, batch["y"].long(), reduction="none")
        return losses, batch["weight"].sum(), {}

    optimizer = make_optimizer("sgd", make_schedule("constant", 0.1))
    state = TorchState.create({k: v.detach() for k, v in model.named_parameters()}, optimizer, seed=0)
    with pytest.raises(ConfigError, match=r"per_example_loss returned loss_sum with shape \(8,\)"):
        make_train_step(per_example_loss, optimizer)(state, _torch_batch(_digits_batches(1, 8)[0]))
    with pytest.raises(ConfigError, match="per_example_loss"):
        make_eval_step(per_example_loss)(state, _torch_batch(_digits_batches(1, 8)[0]))


def test_eval_step_returns_sums():
    model, _, state, _ = _small_setup()
    batch = _torch_batch(_digits_batches(1, 16)[0])
    sums = make_eval_step(classifier_loss(model))(state, batch)
    assert float(sums["weight"]) == 13.0 and 0 <= float(sums["accuracy"]) <= 13.0
    assert float(sums["loss"]) > 13.0 * 1.0  # an untrained 10-class model: about log(10) per example


def test_build_model_matches_the_flax_initialiser_scale():
    model = twin_model(MLPConfig(hidden=[256]), {"x": np.zeros((1, 64), np.float32)}, seed=0)
    std = float(model.dense_0.weight.detach().std())
    assert abs(std - 1 / 8) < 0.01  # lecun normal: 1 / sqrt(fan_in)


def test_buffers_are_updated_in_the_new_state_only():
    """A model with running statistics (BatchNorm): the step returns new buffers, the old ones stay."""
    from torch_bridge.models import stateless
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 10))
    apply = stateless(model)

    def loss_fn(params, buffers, batch, generator):
        logits = apply(params, buffers, batch["x"])
        losses = torch.nn.functional.cross_entropy(logits, batch["y"].long(), reduction="none")
        return (losses * batch["weight"]).sum(), batch["weight"].sum(), {}

    optimizer = make_optimizer("sgd", make_schedule("constant", 0.1))
    state = TorchState.create({k: v.detach() for k, v in model.named_parameters()}, optimizer, seed=0,
                              buffers={k: v.detach() for k, v in model.named_buffers()})
    before = {k: v.clone() for k, v in state.buffers.items()}
    step = make_train_step(loss_fn, optimizer, micro_batches=2)
    new_state, _ = step(state, _torch_batch(_digits_batches(1, 16)[0]))
    assert all(torch.equal(state.buffers[k], before[k]) for k in before)
    assert int(new_state.buffers["1.num_batches_tracked"]) == 2  # one update per micro-batch
    assert not torch.equal(new_state.buffers["1.running_mean"], before["1.running_mean"])
    assert torch.equal(dict(model.named_buffers())["1.running_mean"], before["1.running_mean"])  # module untouched
