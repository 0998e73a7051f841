"""The balancing terms: the auxiliary loss as transformers computes it (padding excluded, all layers pooled),
and ``model.load_balance_scope: global_batch`` exact over micro-batches (``micro_batch`` is not: the test's
teeth)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

from functrain.core.program import as_program
from functrain.core.state import TrainState
from functrain.core.step import make_train_step
from functrain.models import build_model
from functrain.models.configs.mixtral import MixtralConfig
from tests.torch_bridge.hf.test_hf_moe import build_moe_model
from torch_bridge.hf import read_params

ROWS, LENGTH, VOCAB = 8, 9, 64


def hf_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """Right-padded rows (padding: attention_mask 0, label -100) and one row of weight 0."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (ROWS, LENGTH))
    lengths = rng.integers(4, LENGTH + 1, ROWS)
    mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
    weight = np.ones(ROWS, np.float32)
    weight[-1] = 0.0
    return {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask == 1, ids, -100), "weight": weight}


def test_aux_loss_and_total_loss_match_transformers(tmp_path):
    model = build_moe_model("mixtral")
    model.config.output_router_logits = True
    model.config.router_aux_loss_coef = 0.3
    model.router_aux_loss_coef = 0.3
    model.save_pretrained(tmp_path)
    batch = hf_batch()
    batch["weight"][:] = 1.0  # transformers has no row weights: padding through the mask only
    batch["input_ids"] = batch["input_ids"] % model.config.vocab_size
    targets = np.where(batch["attention_mask"][:, 1:] == 1, batch["input_ids"][:, 1:], -100)
    with torch.no_grad():
        reference = model(
            input_ids=torch.tensor(batch["input_ids"][:, :-1]),
            attention_mask=torch.tensor(batch["attention_mask"][:, :-1]),
            labels=torch.tensor(targets),
            shift_labels=torch.tensor(targets),
            output_router_logits=True,
        )
    params, config = read_params(tmp_path)
    assert config.balancing_coefficient() == pytest.approx(0.3)
    program = as_program(build_model(config), batch)
    with jax.default_matmul_precision("highest"):
        loss_sum, weight, aux, _ = jax.jit(program.loss_fn)(params, {}, batch, jax.random.PRNGKey(0))
    np.testing.assert_allclose(aux["moe/aux_loss"] / weight, float(reference.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(loss_sum / weight, float(reference.loss), rtol=1e-5)


CONFIG = MixtralConfig(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
    num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
    router_aux_loss_coef=0.5, router_z_loss_coef=0.1, initializer_range=0.3,
)


def one_step(scope: str, micro_batches: int):
    """(loss, metrics, params) after one SGD step on :func:`hf_batch`."""
    config = CONFIG.model_copy(update={"load_balance_scope": scope})
    batch = {name: jnp.asarray(value) for name, value in hf_batch().items()}
    program = as_program(build_model(config), hf_batch())
    params, model_state = program.init(jax.random.PRNGKey(0))
    tx = optax.sgd(1.0)
    step = make_train_step(
        program.loss_fn, tx, micro_batches=micro_batches, stateful=True, batch_totals=program.batch_totals
    )
    state = TrainState.create(params, tx, jax.random.PRNGKey(1), model_state)
    with jax.default_matmul_precision("highest"):
        new_state, metrics = jax.jit(step)(state, batch)
    return metrics, new_state.params


@pytest.fixture(scope="module")
def steps():
    # One micro-batch is the same program under either scope: compiled once.
    return {key: one_step(*key) for key in (("global_batch", 1), ("global_batch", 4), ("micro_batch", 4))}


def test_global_batch_is_exact_over_micro_batches(steps):
    (whole, whole_params), (split, split_params) = steps["global_batch", 1], steps["global_batch", 4]
    for name in ("loss", "moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean/layer_0"):
        np.testing.assert_allclose(split[name], whole[name], rtol=2e-6, err_msg=name)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), split_params, whole_params)
    assert float(whole["moe/aux_loss"]) > 1.0  # balancing is part of the loss being compared


def test_micro_batch_scope_differs_with_micro_batches(steps):
    (whole, whole_params), (split, split_params) = steps["global_batch", 1], steps["micro_batch", 4]
    assert abs(float(split["moe/aux_loss"]) - float(whole["moe/aux_loss"])) > 1e-3
    difference = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(*map(jax.tree.leaves, (split_params, whole_params))))
    assert difference > 1e-4
