"""The torch backend: checkpoint items round-trip, train calls, config and checkpoint errors, GPT twin."""

from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import linen as nn

import functrain
from functrain.checkpoint import Checkpointer
from functrain.config.load import load_config
from functrain.errors import CheckpointError, ConfigError
from functrain.models.gpt import GPTConfig, build as build_flax_gpt
from functrain.models.mlp import build as build_flax_mlp
from functrain.run.backends import torch_backend as make_backend
from torch_bridge.backend import flatten, nest
from torch_bridge.models import params_from_flax
from torch_bridge.twins import twin_model

REPO = Path(__file__).resolve().parents[2]
FAST = ["train.epochs=null", "train.max_steps=6", "train.steps_per_call=3", "log.every_steps=3",
        "eval.every_steps=0", "checkpoint.every_steps=0", "log.progress=false", "log.tensorboard=false",
        "checkpoint.async_save=false", "data.prefetch=0"]


def _config(tmp_path: Path, *overrides: str):
    return load_config(REPO / "configs" / "mlp_digits_torch.yaml", [f"run.dir={tmp_path / 'run'}", *FAST,
                                                                    *overrides])


def _host_batches(steps: int, rows: int = 64, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.random((steps, rows, 64), dtype=np.float32),
            "y": rng.integers(0, 10, (steps, rows)).astype(np.int32),
            "weight": np.ones((steps, rows), np.float32)}


def _backend(tmp_path: Path, *overrides: str):
    config = _config(tmp_path, *overrides)
    return make_backend(config, {k: v[0] for k, v in _host_batches(1).items()}, 6)


def test_nest_and_flatten_are_inverse():
    flat = {"dense_0.weight": 1, "dense_0.bias": 2, "head.weight": 3}
    assert nest(flat) == {"dense_0": {"weight": 1, "bias": 2}, "head": {"weight": 3}}
    assert flatten(nest(flat)) == flat


def test_train_call_runs_k_steps_and_items_round_trip(tmp_path):
    backend = _backend(tmp_path, "train.micro_batches=2")
    fresh = backend.init_state()
    state, metrics = backend.train_call(fresh, _host_batches(3))
    host = backend.to_host(metrics)
    assert state.step == 3 and fresh.step == 0
    assert set(host) >= {"loss", "weight", "grad_norm", "learning_rate", "skipped_steps", "nonfinite",
                         "accuracy"}
    assert all(value.shape == (3,) for value in host.values()) and np.all(host["weight"] == 64)

    items = backend.state_to_items(state)
    assert set(items["params"]) == {"dense_0", "dense_1", "head"}
    assert items["state"]["step"] == 3 and items["state"]["opt_state"]["count"] == 3
    targets = backend.restore_targets()
    assert jax.tree.structure(targets) == jax.tree.structure(items)
    restored = backend.state_from_items(items, fresh)
    assert restored.step == 3 and restored.seed == state.seed
    for name, value in state.params.items():
        assert torch.equal(restored.params[name], value)
        assert torch.equal(restored.opt_state["nu"][name], state.opt_state["nu"][name])
    # The restored state continues exactly like the original.
    after_a, metrics_a = backend.train_call(state, _host_batches(1, seed=1))
    after_b, metrics_b = backend.train_call(restored, _host_batches(1, seed=1))
    assert torch.equal(metrics_a["loss"], metrics_b["loss"])
    assert all(torch.equal(after_a.params[k], after_b.params[k]) for k in state.params)


def test_params_only_checkpoint_starts_a_fresh_optimizer(tmp_path):
    backend = _backend(tmp_path)
    trained, _ = backend.train_call(backend.init_state(), _host_batches(2))
    state = backend.state_from_items({"params": backend.state_to_items(trained)["params"]}, backend.init_state())
    assert state.step == 0 and int(state.opt_state["count"]) == 0
    assert torch.equal(state.params["head.weight"], trained.params["head.weight"])


def test_jax_checkpoint_with_flax_names_is_rejected_naming_the_parameters(tmp_path):
    """A checkpoint written by the JAX backend has Flax names (kernel); the torch model has weight."""
    config = _config(tmp_path)
    flax_params = nn.meta.unbox(build_flax_mlp(config.model).init(jax.random.PRNGKey(0), np.zeros((1, 64)))["params"])
    with Checkpointer(tmp_path / "run", async_save=False) as checkpointer:
        checkpointer.save(5, {"params": flax_params}, {"step": 5, "backend": "jax"})
    with pytest.raises(CheckpointError, match=r"written by backend jax, this run uses backend torch"):
        functrain.fit(config)
    # The same parameters in a checkpoint that claims to be torch's: the names that differ are listed.
    with Checkpointer(tmp_path / "claims_torch", async_save=False) as checkpointer:
        checkpointer.save(5, {"params": flax_params}, {"step": 5, "backend": "torch"})
    with pytest.raises(CheckpointError, match=r"params/dense_0/weight: missing from checkpoint") as error:
        functrain.fit(_config(tmp_path, f"run.dir={tmp_path / 'claims_torch'}"))
    assert "params/dense_0/kernel: in checkpoint but not in model" in str(error.value)
    backend = _backend(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing \['dense_0.weight', .*unexpected \['dense_0.kernel'"):
        backend.state_from_items({"params": flax_params}, backend.init_state())


def test_unsupported_settings_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.compute_dtype=float16 .* use train.compute_dtype=bfloat16"):
        _backend(tmp_path, "train.compute_dtype=float16")
    with pytest.raises(ConfigError, match="mesh.fsdp=1"):
        _backend(tmp_path, "mesh.fsdp=2")
    with pytest.raises(ConfigError, match="model.name='llama' has no torch twin"):
        twin_model(GPTConfig.model_construct(name="llama"), {}, 0)


def test_fit_with_the_torch_backend_trains_and_evaluates(tmp_path):
    result = functrain.fit(_config(tmp_path, "train.max_steps=9", "optimizer.learning_rate=0.01"))
    assert result.step == 9 and result.stop_reason == "finished"
    assert result.metrics["eval"]["accuracy"] > 0.3  # 9 steps from chance (0.1) on digits
    from functrain.checkpoint import load_params
    params = load_params(tmp_path / "run")
    assert params["dense_0"]["weight"].shape == (128, 64)


def test_torch_gpt_matches_the_flax_gpt():
    """Same weights, same logits; then three SGD-momentum steps with clipping and a token mask agree.

    SGD rather than Adam: attention's key biases have a zero gradient up to rounding (softmax is shift
    invariant), and Adam rescales each framework's different rounding noise into steps of full size. The
    Adam arithmetic and micro-batching are compared on the MLP (tests/torch_bridge/test_torch_step.py).
    """
    import optax
    from functrain.core import step as jax_step
    from functrain.core.state import TrainState
    from functrain.core.losses import causal_lm_loss as flax_lm_loss
    from torch_bridge import TorchState, make_optimizer, make_schedule, make_train_step
    from torch_bridge.models import causal_lm_loss

    config = GPTConfig(vocab_size=30, max_len=8, d_model=16, n_layers=1, n_heads=2, d_ff=32)
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 30, (4, 9)).astype(np.int32), "weight": np.ones(4, np.float32),
                "mask": (rng.random((4, 8)) > 0.2).astype(np.float32)} for _ in range(3)]
    flax_model = build_flax_gpt(config)
    flax_params = nn.meta.unbox(flax_model.init(jax.random.PRNGKey(0), batches[0]["tokens"][:, :-1])["params"])
    model = twin_model(config, {}, seed=0)
    converted = params_from_flax(flax_params)
    assert set(converted) == set(dict(model.named_parameters()))
    model.load_state_dict(converted)
    tokens = batches[0]["tokens"][:, :-1]
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(logits, np.asarray(flax_model.apply({"params": flax_params}, tokens)),
                               rtol=1e-5, atol=1e-5)

    tx = optax.sgd(0.1, momentum=0.9)
    jstep = jax.jit(jax_step.make_train_step(flax_lm_loss(flax_model, True), tx, clip_norm=0.3))
    jstate = TrainState.create(flax_params, tx, jax.random.PRNGKey(0))
    optimizer = make_optimizer("sgd", make_schedule("constant", 0.1), momentum=0.9)
    tstep = make_train_step(causal_lm_loss(model), optimizer, clip_norm=0.3)
    tstate = TorchState.create(converted, optimizer, seed=0)
    for batch in batches:
        jstate, jm = jstep(jstate, batch)
        tstate, tm = tstep(tstate, {k: torch.from_numpy(v) for k, v in batch.items()})
        for key in ("loss", "weight", "grad_norm", "accuracy"):
            np.testing.assert_allclose(float(tm[key]), float(jm[key]), rtol=1e-5, atol=1e-6, err_msg=key)
