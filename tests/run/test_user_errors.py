"""Bad user code and data through ``fit``: one line naming the thing and the fix, nothing on disk touched."""

import inspect
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functrain
from examples import plain_functions
from functrain.commands import cli
from functrain.callbacks.base import Callback
from functrain.errors import CheckpointError, ConfigError, DataError, user_code_failure

MODEL = functrain.FunctionalModel(plain_functions.init, plain_functions.apply)
DATA = {"x": np.random.default_rng(0).random((64, 64), dtype=np.float32), "y": np.arange(64, dtype=np.int32) % 10}


def fit_error(tmp_path, error, **kwargs) -> str:
    """The one-line message of ``error`` raised by a fit into a fresh run directory, which stays absent."""
    run_dir = tmp_path / "run"
    kwargs = {"model": MODEL, "train_data": DATA, **kwargs}
    with pytest.raises(error) as info:
        functrain.fit(plain_functions.CONFIG, **kwargs, **{"run.dir": str(run_dir), "train.max_steps": 2})
    assert not run_dir.exists()
    message = str(info.value)
    assert "\n" not in message
    return message


def mean_loss(params, batch, rng):
    logits = plain_functions.apply(params, batch["x"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])), 1.0, {}


def test_a_loss_returning_a_mean_or_the_wrong_structure(tmp_path):
    assert "looks like a mean" in fit_error(tmp_path, ConfigError, loss_fn=mean_loss)
    single = lambda p, b, r: mean_loss(p, b, r)[0]  # noqa: E731
    message = fit_error(tmp_path, ConfigError, loss_fn=single)  # the shapes, not "returned ShapeDtypeStruct"
    assert "returned one value, float32[] where a 3-tuple was expected" in message
    assert "(loss_sum, weight, aux_sums)" in message and "ShapeDtypeStruct" not in message
    vector = lambda p, b, r: (jnp.zeros(3), 1.0, {})  # noqa: E731
    assert "loss_sum of shape (3,)" in fit_error(tmp_path, ConfigError, loss_fn=vector)


def test_model_output_that_does_not_fit_the_builtin_loss(tmp_path):
    model = functrain.FunctionalModel(plain_functions.init, lambda p, x: plain_functions.apply(p, x)[:, :, None])
    message = fit_error(tmp_path, ConfigError, model=model)
    assert "float32[32, 10, 1]" in message and "[batch, classes]" in message and "loss_fn=" in message


def test_data_missing_a_field_or_with_unequal_records(tmp_path):
    reads_label = lambda p, b, r: (jnp.sum(b["label"]), jnp.sum(b["weight"]), {})  # noqa: E731
    assert "'label'" in fit_error(tmp_path, DataError, loss_fn=reads_label)
    assert "no labels for input 'x'" in fit_error(tmp_path, DataError, train_data={"x": DATA["x"]})
    ragged = [{"x": np.zeros(64 if i % 2 else 63, np.float32), "y": np.int32(1)} for i in range(64)]
    assert "field 'x' of different shapes" in fit_error(tmp_path, DataError, train_data=ragged)


def test_an_optimizer_that_is_not_a_gradient_transformation(tmp_path):
    assert "not an optax.GradientTransformation" in fit_error(tmp_path, ConfigError, optimizer="adam")
    assert "returned int from the schedule" in fit_error(tmp_path, ConfigError, optimizer=lambda lr: 3)


@pytest.mark.parametrize("target, expected", [
    ("no_such_package.models:build", "cannot import 'no_such_package.models'"),
    ("examples.plain_functions:build_model", "has no attribute 'build_model'"),
    ("examples.plain_functions:load_data", "returned: model dict is not"),
])
def test_bad_import_paths_exit_2_from_the_cli(tmp_path, capsys, target, expected):
    config = tmp_path / "bad.yaml"
    config.write_text(f"model: {{target: '{target}'}}\ndata: {{name: digits}}\ntrain: {{max_steps: 2}}\n")
    assert cli.main(["train", str(config), f"run.dir={tmp_path / 'run'}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"model.target={target!r}" in lines[0] and expected in lines[0]
    assert not (tmp_path / "run").exists()


def _snapshot(run_dir):
    return {str(path.relative_to(run_dir)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in sorted(run_dir.rglob("*"))}


def test_resuming_with_a_different_user_model_names_the_parameter(tmp_path):
    run_dir = tmp_path / "run"
    settings = {"run.dir": str(run_dir), "train.max_steps": 2, "log.every_steps": 1}
    functrain.fit(plain_functions.CONFIG, model=MODEL, loss_fn=plain_functions.loss_fn, train_data=DATA, **settings)
    before = _snapshot(run_dir)

    def narrower(rng, batch):
        return {**plain_functions.init(rng, batch), "w1": jnp.zeros((64, 32)), "b1": jnp.zeros(32),
                "w2": jnp.zeros((32, 10))}
    with pytest.raises(CheckpointError) as info:
        functrain.fit(plain_functions.CONFIG, model=functrain.FunctionalModel(narrower, plain_functions.apply),
                      loss_fn=plain_functions.loss_fn, train_data=DATA, **{**settings, "train.max_steps": 4})
    assert "w1: checkpoint float32[64,64] vs model float32[64,32]" in str(info.value)
    assert "\n" not in str(info.value)
    assert _snapshot(run_dir) == before


class Arm(Callback):
    """Arms the failing user code below once the run reached ``step`` (so it fails mid-run, after a checkpoint)."""

    def __init__(self, step):
        self.step, self.armed = step, False

    def on_step_end(self, view):
        self.armed = self.armed or view.step >= self.step


class Boom(Callback):
    def on_step_end(self, view):
        if view.step == 4:
            raise RuntimeError("the callback\nbroke")


def mid_run_failure(tmp_path, error, **kwargs):
    """The one-line report of a 4-step fit (2 steps a call, a checkpoint every 2) whose user code fails mid-run with
    ``error`` (raised on as it is: the line attached, shown as its note), and the exception."""
    settings = {"run.dir": str(tmp_path / "run"), "train.max_steps": 4, "train.steps_per_call": 2,
                "checkpoint.every_steps": 2, "log.every_steps": 2, "data.prefetch": 0}
    with pytest.raises(error) as info:
        functrain.fit(plain_functions.CONFIG, model=MODEL, train_data=DATA, **{**settings, **kwargs})
    line = user_code_failure(info.value)
    assert line is not None and "\n" not in line
    assert getattr(info.value, "__notes__", [f"functrain: {line}"])[-1] == f"functrain: {line}"  # Python 3.11+
    return line, info.value


def line_of(function, text):
    """``tests/run/test_user_errors.py:N``: the line of ``function``'s source that holds ``text``."""
    lines, first = inspect.getsourcelines(function)
    return f"{Path(__file__).relative_to(Path.cwd())}:{first + next(i for i, line in enumerate(lines) if text in line)}"


def test_a_callback_that_raises_mid_run_is_one_line_with_its_step_file_line_and_checkpoint(tmp_path):
    message, _ = mid_run_failure(tmp_path, RuntimeError, callbacks=[Boom()])
    assert message == (f"at step 4, your function Boom.on_step_end ({line_of(Boom.on_step_end, 'raise')}) raised "
                       f"RuntimeError: the callback broke; the last checkpoint, step 2, is whole: fix it and run the "
                       f"same command again to resume from there")


def test_a_transform_that_raises_mid_run_names_the_step_whose_batch_it_was_making(tmp_path):
    arm = Arm(2)

    def crop(record, rng):
        if arm.armed:
            raise IndexError("crop out of range")
        return record

    message, _ = mid_run_failure(tmp_path, IndexError, callbacks=[arm], transform=crop)
    assert message == (f"at step 3, your function {crop.__qualname__} ({line_of(crop, 'raise')}) raised IndexError: "
                       f"crop out of range; the last checkpoint, step 2, is whole: fix it and run the same command "
                       f"again to resume from there")


def test_a_loss_fn_that_raises_when_evaluation_traces_it_is_one_line(tmp_path):
    arm = Arm(2)  # the first evaluation, at step 4, traces the loss again: it fails there

    def loss_fn(params, batch, rng):
        if arm.armed:
            raise ValueError("unexpected batch")
        return plain_functions.loss_fn(params, batch, rng)

    message, _ = mid_run_failure(tmp_path, ValueError, callbacks=[arm], loss_fn=loss_fn, eval_data=DATA,
                                 **{"eval.every_steps": 4})
    assert message == (f"at step 4, your function {loss_fn.__qualname__} ({line_of(loss_fn, 'raise')}) raised "
                       f"ValueError: unexpected batch; the last checkpoint, step 2, is whole: fix it and run the same "
                       f"command again to resume from there")


def test_user_code_failing_at_the_first_step_says_there_is_no_checkpoint_yet(tmp_path):
    arm = Arm(0)  # armed at on_train_begin: the build's example batch passes, the first step's fails

    def first(record, rng):
        if arm.armed:
            raise KeyError("x")
        return record

    arm.on_train_begin = arm.on_step_end
    message, _ = mid_run_failure(tmp_path, KeyError, callbacks=[arm], transform=first)
    assert message == (f"at step 1, your function {first.__qualname__} ({line_of(first, 'raise')}) raised KeyError: "
                       f"'x'; no checkpoint yet: fix it and run the same command again (the run starts over)")


TRANSFORM = """
def crop(record, rng):
    if rng.bit_generator.state["state"]["key"][0] >= 128:  # the record's stream index: step 3's batch on
        raise IndexError("crop out of range")
    return record
"""


def test_from_the_cli_user_code_failing_mid_run_exits_2_in_one_line_apart_from_the_progress_bar(
        tmp_path, capsys, monkeypatch):
    (tmp_path / "mid_run_transform.py").write_text(TRANSFORM)
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [f"run.dir={tmp_path / 'run'}", "data.transform=mid_run_transform:crop", "train.epochs=null",
                 "train.max_steps=4", "train.steps_per_call=2", "checkpoint.every_steps=2", "eval.every_steps=0",
                 "log.every_steps=2",
                 "log.progress=true", "log.tensorboard=false", "log.plot=false"]
    assert cli.main(["train", "configs/mlp_digits.yaml", *overrides]) == 2
    err = capsys.readouterr().err
    assert "0/4" in err  # the bar was drawn; its line ended before the error's
    assert err.endswith(f"\nfunctrain: error: at step 3, your function crop ({tmp_path / 'mid_run_transform.py'}:4) "
                        f"raised IndexError: crop out of range; the last checkpoint, step 2, is whole: fix it and run "
                        f"the same command again to resume from there\n")
