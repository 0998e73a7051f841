"""Data the way users have it (issue #22): field conventions, the explicit map, HF ``-100`` labels and
``attention_mask``, state-updating user losses (BatchNorm), and one-line refusals of what does not fit."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functrain
from examples import flax_batchnorm, hf_datasets_lm
from functrain.commands import cli
from functrain.core.fields import resolve_fields
from functrain.errors import ConfigError, DataError

QUIET = {"log.progress": False, "log.every_steps": 10, "eval.every_steps": 0}
ROWS = 64


def _classifier_data(inputs="image", labels="label"):
    rng = np.random.default_rng(0)
    return {inputs: rng.random((ROWS, 8, 8, 1), dtype=np.float32), labels: np.arange(ROWS, dtype=np.int32) % 10}


class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(10)(x.reshape((x.shape[0], -1)))


def _fit(tmp_path, **kwargs):
    config = {"data": {"global_batch_size": 16}, "train": {"max_steps": 2}, **kwargs.pop("config", {})}
    return functrain.fit(config, **{"run.dir": str(tmp_path / "run"), **QUIET, **kwargs})


def _error(tmp_path, error, **kwargs) -> str:
    with pytest.raises(error) as info:
        _fit(tmp_path, **kwargs)
    assert not (tmp_path / "run").exists()
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------------- conventions

@pytest.mark.parametrize("inputs, labels", [("x", "y"), ("image", "label"), ("x", "label"), ("inputs", "labels"),
                                            ("pixel_values", "labels")])
def test_classifier_conventions(inputs, labels):
    fields = resolve_fields(_classifier_data(inputs, labels))
    assert (fields.kind, fields.inputs, fields.labels) == ("classifier", inputs, labels)


def test_lm_conventions():
    ids = np.zeros((2, 8), np.int32)
    tokens = resolve_fields({"tokens": ids, "labels": np.zeros(2, np.int32)})
    assert (tokens.kind, tokens.inputs, tokens.hf) == ("causal_lm", "tokens", False)
    hf = resolve_fields({"input_ids": ids, "labels": ids, "attention_mask": ids})
    assert (hf.kind, hf.inputs, hf.labels, hf.attention_mask, hf.hf) == ("causal_lm", "input_ids", "labels",
                                                                         "attention_mask", True)


def test_a_linen_model_on_image_label_data_trains_with_the_builtin_loss(tmp_path):
    result = _fit(tmp_path, model=Dense(), train_data=_classifier_data())
    assert result.step == 2 and result.metrics["train"]["weight"] == 16.0


def test_the_explicit_map_names_inputs_and_labels(tmp_path):
    data = _classifier_data("pic", "target")
    result = _fit(tmp_path, model=Dense(), train_data=data, inputs=("pic",), labels="target")
    assert result.step == 2
    recorded = (tmp_path / "run" / "config.yaml").read_text()
    assert "inputs:" in recorded and "pic" in recorded and "labels: target" in recorded
    # The same map from the config; fit's keyword wins over it.
    result = _fit(tmp_path, model=Dense(), train_data=data, labels="target", config={
        "data": {"global_batch_size": 16, "fields": {"inputs": "pic", "labels": "nope"}}},
                  **{"run.dir": str(tmp_path / "from_config")})
    assert result.step == 2


# --------------------------------------------------------------------------------------------- refusals

def test_two_candidate_inputs_are_refused_naming_both(tmp_path):
    data = {**_classifier_data("x"), "image": np.zeros((ROWS, 8, 8, 1), np.float32)}
    message = _error(tmp_path, DataError, model=Dense(), train_data=data)
    assert "'x' and 'image'" in message and "data.fields.inputs" in message and "fit(..., inputs=" in message


def test_a_map_naming_a_missing_field_or_labels_of_no_loss_shape(tmp_path):
    data = _classifier_data()
    message = _error(tmp_path, DataError, model=Dense(), train_data=data, inputs="pixels")
    assert "'pixels'" in message and "['image', 'label']" in message and "data.fields.inputs" in message
    bad = {**data, "box": np.zeros((ROWS, 4), np.float32)}
    message = _error(tmp_path, DataError, model=Dense(), train_data=bad, labels="box")
    assert "'box'" in message and "fits no built-in loss" in message and "data.fields.labels" in message
    message = _error(tmp_path, DataError, model=Dense(), train_data={"image": data["image"]})
    assert "no labels" in message and "['image']" in message and "fit(..., labels=" in message


def test_user_losses_of_the_wrong_arity_or_state_are_refused(tmp_path):
    train, _ = flax_batchnorm.load_data()
    model = flax_batchnorm.MODEL
    two = lambda params, batch: (0.0, 1.0, {})  # noqa: E731
    assert "takes 2 positional arguments" in _error(tmp_path, ConfigError, model=model, loss_fn=two,
                                                     train_data=train)
    three = lambda params, batch, rng: flax_batchnorm.loss_fn(params, batch, None, {})[:3]  # noqa: E731
    assert "loss_fn(params, batch, rng, model_state)" in _error(tmp_path, ConfigError, model=model, loss_fn=three,
                                                                train_data=train)

    def mean(params, batch, rng, model_state):
        loss_sum, weight, aux, state = flax_batchnorm.loss_fn(params, batch, rng, model_state)
        return loss_sum / weight, jnp.float32(1.0), aux, state
    assert "looks like a mean" in _error(tmp_path, ConfigError, model=model, loss_fn=mean, train_data=train)


def test_the_cli_exits_2_on_a_bad_field_map_and_writes_nothing(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("model: {target: 'examples.flax_batchnorm:CNN'}\n"
                      "data: {target: 'examples.flax_batchnorm:load_data', fields: {inputs: pixels}}\n"
                      "train: {max_steps: 2}\n")
    assert cli.main(["train", str(config), f"run.dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "data.fields.inputs names 'pixels'" in lines[0]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ HF LM labels

VOCAB, LENGTH = 16, 12


def _hf_data() -> dict:
    """Half of each record follows ``t -> t + 1`` (learnable), half is random with ``-100`` labels, and the
    last two positions are padding (random labels, ``attention_mask`` 0): only the first half counts."""
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, (ROWS, 1))
    ids = np.concatenate([(start + np.arange(6)) % VOCAB, rng.integers(0, VOCAB, (ROWS, 6))], 1).astype(np.int32)
    labels = ids.copy()
    labels[:, 6:10] = -100
    mask = np.ones_like(ids)
    mask[:, 10:] = 0
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def bigram_init(rng, batch):
    return {"table": jnp.zeros((VOCAB, VOCAB))}


def bigram_apply(params, input_ids):
    return params["table"][input_ids]


def test_minus_100_and_padding_are_not_counted_on_jax(tmp_path):
    result = _fit(tmp_path, model=functrain.FunctionalModel(bigram_init, bigram_apply), train_data=_hf_data(),
                  config={"optimizer": {"name": "adamw", "learning_rate": 0.5}},
                  **{"train.max_steps": 40, "train.steps_per_call": 10})
    # Targets 1..5 of each record count (HF's shift): 5 per record, 16 records a batch.
    assert result.metrics["train"]["weight"] == 16 * 5
    assert result.metrics["train"]["loss"] < 0.05  # counting the random part would keep it near log(16)


def test_minus_100_and_attention_mask_on_torch_by_keyword(tmp_path):
    torch = pytest.importorskip("torch")

    class Bigram(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(VOCAB, VOCAB)
            self.masks_seen = 0

        def forward(self, input_ids, attention_mask=None):
            self.masks_seen += attention_mask is not None and attention_mask.shape == input_ids.shape
            return self.table(input_ids)

    model = Bigram()
    result = _fit(tmp_path, model=model, train_data=_hf_data(), backend="torch",
                  config={"optimizer": {"name": "adamw", "learning_rate": 0.5}}, **{"train.max_steps": 40})
    assert model.masks_seen > 0
    assert result.metrics["train"]["weight"] == 16 * 5 and result.metrics["train"]["loss"] < 0.05


# -------------------------------------------------------------------------------- state-updating losses

def test_evaluation_uses_the_running_statistics(tmp_path):
    result = flax_batchnorm.main(str(tmp_path / "run"), 10, **{**QUIET, "eval.every_steps": 10})
    state = result.state
    initial = flax_batchnorm.MODEL.init(jax.random.PRNGKey(0), np.zeros((1, 8, 8, 1), np.float32))["batch_stats"]
    assert not np.allclose(jax.tree.leaves(state.model_state)[0], jax.tree.leaves(initial)[0])
    _, evaluation = flax_batchnorm.load_data()
    batch = {**evaluation, "weight": np.ones(len(evaluation["label"]), np.float32)}
    loss_sum, weight, _, _ = flax_batchnorm.loss_fn(state.params, batch, None, state.model_state)
    assert abs(float(loss_sum / weight) - result.metrics["eval"]["loss"]) < 1e-4
    batch_mode = flax_batchnorm.loss_fn(state.params, batch, jax.random.PRNGKey(0), state.model_state)
    assert abs(float(batch_mode[0] / batch_mode[1]) - result.metrics["eval"]["loss"]) > 1e-4


# ----------------------------------------------------------------------------------------------- transform

def flat_records() -> dict:
    """Digits as a data source might hold them: flat pixels and a ``digit`` field."""
    data = _classifier_data()
    return {"pixels": data["image"].reshape(ROWS, 64), "digit": data["label"]}


def to_image(record, rng):
    """A per-record transform into the Flax convention."""
    return {"image": record["pixels"].reshape(8, 8, 1), "label": record["digit"]}


def test_a_transform_reshapes_records_from_fit_or_the_config(tmp_path):
    passed = _fit(tmp_path, model=Dense(), train_data=flat_records(), eval_data=flat_records(), transform=to_image,
                  **{"eval.every_steps": 2})
    assert passed.step == 2 and passed.metrics["eval"]["weight"] == ROWS
    config = tmp_path / "transform.yaml"
    config.write_text("model: {target: 'test_data_fields:Dense'}\n"
                      "data: {target: 'test_data_fields:flat_records', transform: 'test_data_fields:to_image', "
                      "global_batch_size: 16}\ntrain: {max_steps: 2}\nlog: {progress: false}\n")
    assert cli.main(["train", str(config), f"run.dir={tmp_path / 'yaml'}"]) == 0
    assert functrain.checkpoint.load_params(tmp_path / "yaml").keys() == passed.state.params.keys()


def test_hf_fields_accumulate_exactly(tmp_path):
    """Micro-batches divide by the global count of counted tokens, not a mean of micro-batch means."""
    model = functrain.FunctionalModel(bigram_init, bigram_apply)
    data = _hf_data()
    data["labels"][:8, 1:4] = -100  # records with fewer counted tokens: unequal counts per micro-batch
    runs = [_fit(tmp_path, model=model, train_data=data, **{"run.dir": str(tmp_path / str(m)),
                                                            "train.micro_batches": m}) for m in (1, 4)]
    assert np.abs(np.asarray(runs[0].state.params["table"]) - np.asarray(runs[1].state.params["table"])).max() < 1e-6


def test_a_torch_module_on_image_label_data(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = _fit(tmp_path, model=model, train_data=_classifier_data(), backend="torch")
    assert result.step == 2 and result.metrics["train"]["weight"] == 16.0


class KeywordDense(nn.Module):
    @nn.compact
    def __call__(self, *, pixels):
        return nn.Dense(10)(pixels.reshape((pixels.shape[0], -1)))


def test_a_mapping_passes_the_input_by_keyword(tmp_path):
    result = _fit(tmp_path, model=KeywordDense(), train_data=_classifier_data(), inputs={"pixels": "image"})
    assert result.step == 2
    assert "pixels: image" in (tmp_path / "run" / "config.yaml").read_text()
    torch = pytest.importorskip("torch")

    class Keyword(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 10)

        def forward(self, *, pixel_values):
            return self.linear(pixel_values.flatten(1))

    result = _fit(tmp_path, model=Keyword(), train_data=_classifier_data(), backend="torch",
                  inputs={"pixel_values": "image"}, **{"run.dir": str(tmp_path / "torch")})
    assert result.step == 2


def test_the_hf_lm_example_on_jax_and_the_torch_twin(tmp_path):
    jax_run = hf_datasets_lm.main(str(tmp_path / "jax"), 2, **QUIET)
    assert jax_run.step == 2 and 0 < jax_run.metrics["train"]["weight"] < 32 * (hf_datasets_lm.SEQ_LEN - 1)
    pytest.importorskip("torch")
    torch_run = hf_datasets_lm.main(str(tmp_path / "torch"), 2, backend="torch", **QUIET)
    assert torch_run.step == 2 and torch_run.metrics["train"]["weight"] == jax_run.metrics["train"]["weight"]


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_padded_keys_are_not_attended_to_by_the_registry_gpt(tmp_path, backend):
    """Left padding: what the pad tokens are must not change the loss of the real tokens."""
    if backend == "torch":
        pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, (ROWS, LENGTH)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, :4] = 0
    losses = []
    for pad in (0, 7):
        padded = np.where(mask == 1, ids, pad).astype(np.int32)
        labels = np.where(mask == 1, ids, -100)
        labels[:, 4] = -100  # the first real token is predicted from a pad query: not a key question
        data = {"input_ids": padded, "attention_mask": mask, "labels": labels}
        result = _fit(tmp_path, train_data=data, backend=backend, config={
            "model": {"name": "gpt", "vocab_size": VOCAB, "max_len": LENGTH, "d_model": 16, "n_layers": 1,
                      "n_heads": 2, "d_ff": 32}, "data": {"global_batch_size": 16, "seq_len": LENGTH - 1}},
                      **{"train.max_steps": 1, "run.dir": str(tmp_path / f"{backend}{pad}")})
        losses.append(result.metrics["train"]["loss"])
    assert abs(losses[0] - losses[1]) < 1e-6
