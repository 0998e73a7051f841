"""backend: jax and backend: torch train the same thing: for a classifier, a causal LM and a packed causal LM,
with adamw, sgd and lion, three steps from the same weights give the same losses and parameters (fp32).

Each side is built from its pieces, as the builder builds them: the Flax model with
``functrain.core.step.make_train_step`` and ``named_optimizer(settings)``; the torch twin with
``torch_bridge.step.make_train_step``, its loss and ``torch_bridge.optim.from_settings(settings)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn

from functrain.core import step as jax_step
from functrain.core.losses import causal_lm_loss as flax_lm_loss, classifier_loss as flax_classifier_loss
from functrain.core.optim import OptimizerSettings, ScheduleSettings, named_optimizer
from functrain.core.state import TrainState
from functrain.data.token_store import StoreWriter, TokenStore
from functrain.data.token_windows import TokenWindows
from functrain.models.gpt import GPTConfig, build as build_flax_gpt
from functrain.models.mlp import MLPConfig, build as build_flax_mlp
from torch_bridge import models
from torch_bridge.optim import from_settings
from torch_bridge.step import TorchState, make_train_step
from torch_bridge.twins import twin_model

STEPS, ROWS, SEQ_LEN, VOCAB = 3, 8, 12, 32
TOLERANCE = 1e-5
GPT = GPTConfig(vocab_size=VOCAB, max_len=SEQ_LEN, d_model=16, n_layers=1, n_heads=2, d_ff=32)
SCHEDULE = ScheduleSettings("cosine", 1e-2, warmup_steps=1, total_steps=STEPS, end_lr_ratio=0.1)
OPTIMIZERS = {
    "adamw": OptimizerSettings("adamw", SCHEDULE, 0.1, {"b1": 0.9, "b2": 0.99, "eps": 1e-8, "mu_dtype": None}),
    "sgd": OptimizerSettings("sgd", SCHEDULE, 0.1, {"momentum": 0.9, "nesterov": True, "accumulator_dtype": None}),
    "lion": OptimizerSettings("lion", ScheduleSettings("constant", 1e-3, 0, STEPS), 0.1, {"b1": 0.9, "b2": 0.99}),
}
# First moments stored in bfloat16 (optimizer.mu_dtype), on the classifier only: the arithmetic is the
# optimizer's, which tests/torch_bridge/test_torch_optim.py checks moment by moment.
LOW_PRECISION_MOMENTS = {f"{name}_mu_bfloat16": OptimizerSettings(name, OPTIMIZERS[name].schedule, 0.1,
                                                                  {**OPTIMIZERS[name].options, "mu_dtype": "bfloat16"})
                         for name in ("adamw", "lion")}
CASES = [(task, name) for task in ("classifier", "causal_lm", "packed_causal_lm") for name in sorted(OPTIMIZERS)]
CASES += [("classifier", name) for name in LOW_PRECISION_MOMENTS]
# Attention's key biases cannot change the output (softmax is shift invariant): their gradient is rounding
# noise, which Lion's sign() turns into steps of full size (lr) that differ between the frameworks. Nothing
# else depends on them, so with lion they are held only to that bound; the losses and every other parameter
# are compared as tightly as everywhere else.
SHIFT_INVARIANT = ".key.bias"


def _classifier_batches(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    weight = np.ones(ROWS, np.float32)
    weight[-2:] = 0.0  # padding rows
    return [{"x": rng.random((ROWS, 64), dtype=np.float32), "y": rng.integers(0, 10, ROWS).astype(np.int32),
             "weight": weight} for _ in range(STEPS)]


def _lm_batches(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    weight = np.ones(ROWS, np.float32)
    weight[-1] = 0.0
    return [{"tokens": rng.integers(0, VOCAB, (ROWS, SEQ_LEN + 1)).astype(np.int32), "weight": weight,
             "mask": (rng.random((ROWS, SEQ_LEN)) > 0.2).astype(np.float32)} for _ in range(STEPS)]


def _packed_batches(rng: np.random.Generator, directory) -> list[dict[str, np.ndarray]]:
    """Windows of a token store with ``data.packing: true`` (documents of 1 to 9 tokens, several per row)."""
    lengths = rng.integers(1, 10, 200).tolist()
    with StoreWriter(directory / "store", VOCAB, {"name": "parity", "xxh64": None, "eos_id": None}) as writer:
        writer.add(rng.integers(0, VOCAB, sum(lengths)), lengths)
    windows = TokenWindows(TokenStore.open(directory / "store"), SEQ_LEN, packing=True)
    batches = [windows.gather(np.arange(step * ROWS, (step + 1) * ROWS)) for step in range(STEPS)]
    for batch in batches:
        batch["weight"] = np.ones(ROWS, np.float32)
        assert batch["segment_ids"].max() > 2  # several documents per row: packing is exercised
    return batches


def _models(task: str, example: dict[str, np.ndarray]):
    """(Flax module, its loss, initial Flax params, torch twin, its loss) for ``task``."""
    if task == "classifier":
        flax_model = build_flax_mlp(MLPConfig(hidden=[16], num_classes=10))
        flax_params = flax_model.init(jax.random.PRNGKey(0), example["x"])["params"]
        twin = models.MLP(64, [16], 10)
        return flax_model, flax_classifier_loss(flax_model, True), nn.meta.unbox(flax_params), twin, \
            models.classifier_loss(twin)
    flax_model = build_flax_gpt(GPT)
    flax_params = flax_model.init(jax.random.PRNGKey(0), example["tokens"][:, :-1])["params"]
    twin = twin_model(GPT, {}, seed=0)
    return flax_model, flax_lm_loss(flax_model, True), nn.meta.unbox(flax_params), twin, models.causal_lm_loss(twin)


@pytest.mark.parametrize("task,optimizer", CASES)
def test_three_steps_agree(task, optimizer, tmp_path):
    rng = np.random.default_rng(0)
    batches = {"classifier": _classifier_batches, "causal_lm": _lm_batches,
               "packed_causal_lm": lambda r: _packed_batches(r, tmp_path)}[task](rng)
    _, flax_loss, flax_params, twin, twin_loss = _models(task, batches[0])
    settings = {**OPTIMIZERS, **LOW_PRECISION_MOMENTS}[optimizer]

    tx = named_optimizer(settings)
    jstep = jax.jit(jax_step.make_train_step(flax_loss, tx, learning_rate_fn=settings.schedule.optax()))
    jstate = TrainState.create(flax_params, tx, jax.random.PRNGKey(0))
    tx_torch = from_settings(settings)
    tstep = make_train_step(twin_loss, tx_torch)
    tstate = TorchState.create(models.params_from_flax(flax_params), tx_torch, seed=0)

    for batch in batches:
        jstate, jm = jstep(jstate, {k: jnp.asarray(v) for k, v in batch.items()})
        tstate, tm = tstep(tstate, {k: torch.from_numpy(v) for k, v in batch.items()})
        for key in ("loss", "weight", "learning_rate"):
            np.testing.assert_allclose(float(tm[key]), float(jm[key]), rtol=TOLERANCE, atol=TOLERANCE, err_msg=key)
    final, initial = models.params_from_flax(jax.device_get(jstate.params)), models.params_from_flax(flax_params)
    for name, value in tstate.params.items():
        noise_bound = 2 * STEPS * settings.schedule.learning_rate * (1 + settings.weight_decay)
        tolerance = noise_bound if settings.name == "lion" and name.endswith(SHIFT_INVARIANT) else TOLERANCE
        np.testing.assert_allclose(value.numpy(), final[name].numpy(), rtol=0, atol=tolerance, err_msg=name)
    moved = max(float((tstate.params[name] - initial[name]).abs().max()) for name in initial)
    assert moved > 100 * TOLERANCE  # the parameters did move: the comparison is not vacuous
