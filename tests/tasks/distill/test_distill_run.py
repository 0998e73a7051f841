"""``task: distill`` through ``functrain train``: the teacher's weights land in the state, the run trains and
resumes bitwise after a kill, and bad input is one line, exit 2, with nothing written."""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
import yaml
from tests.commands.test_verify_resume import assert_resumes_as_uninterrupted
from tests.conftest import run_python

from functrain.checkpoint import Checkpointer
from functrain.commands.cli import main
from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from functrain.run.build import build_run
from functrain.config.load import load_config
from functrain.tasks.distill.task import TEACHER

TEACHER_MODEL = {"name": "gpt", "vocab_size": 256, "max_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2,
                 "d_ff": 64, "dropout": 0.0}
STUDENT = {**TEACHER_MODEL, "d_model": 16, "n_layers": 1, "d_ff": 32}


def write_teacher(directory, model=TEACHER_MODEL):
    """A run directory holding one checkpoint of a random teacher and its config.yaml; returns its params."""
    module = build_model(GPTConfig(**{key: value for key, value in model.items() if key != "name"}))
    variables = jax.jit(module.init)(jax.random.PRNGKey(5), np.zeros((1, 8), np.int32))  # whole, not op by op
    params = jax.tree.map(np.asarray, nn.meta.unbox(variables["params"]))
    saver = Checkpointer(directory, keep=None, async_save=False)
    saver.save(7, {"params": params}, {"model": model})
    saver.close()
    (directory / "config.yaml").write_text(yaml.safe_dump({"model": model}))
    return params


def write_config(tmp_path, teacher, **sections):
    """A tiny distillation config on the bundled text; ``sections`` update its sections."""
    config = {"seed": 0, "task": "distill", "run": {"dir": str(tmp_path / "run")}, "model": dict(STUDENT),
              "distill": {"teacher": str(teacher), "loss": "jsd", "beta": 0.5, "temperature": 2.0, "alpha": 0.5},
              "data": {"name": "char_text", "seq_len": 12, "global_batch_size": 4, "eval_fraction": 0.002},
              "optimizer": {"name": "adamw", "learning_rate": 1e-2}, "train": {"max_steps": 4},
              "log": {"every_steps": 1, "progress": False, "tensorboard": False},
              "eval": {"every_steps": 4, "max_batches": 2},
              "checkpoint": {"every_steps": 2, "async_save": False}}
    for name, values in sections.items():
        config[name] = values if values is None else {**config.get(name, {}), **values}
    config = {name: values for name, values in config.items() if values is not None}
    path = tmp_path / "distill.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    directory = tmp_path_factory.mktemp("teacher") / "run"
    return directory, write_teacher(directory)


def assert_teacher_loaded(config, weights):
    """A fresh start of ``config``, once its start hooks ran, holds ``weights`` as the teacher's; returns it."""
    run = build_run(load_config(config))
    start = run.resume.start(run.open_checkpointer(), run.backend, run.sampler)
    for hook in run.start_hooks:
        start.state = hook(run.backend, start.state, start.restored_step)
    held = start.state.model_state[TEACHER]
    assert int(held["loaded"]) == 1
    assert jax.tree.structure(held["params"]) == jax.tree.structure(weights)
    for got, want in zip(jax.tree.leaves(held["params"]), jax.tree.leaves(weights)):
        np.testing.assert_array_equal(np.asarray(got), want)
    return start.state


def test_the_teacher_is_loaded_into_the_state_and_the_run_resumes_bitwise(tmp_path, teacher):
    """The resume: verify-resume's check (one subprocess: the SIGKILLed run) over 6 steps killed at a random one."""
    directory, weights = teacher
    config = write_config(tmp_path, directory)
    assert_teacher_loaded(config, weights)
    assert_resumes_as_uninterrupted(config, tmp_path, 6)


def test_a_student_started_from_another_run_gets_the_teacher_too(tmp_path, teacher):
    """train.init_from: the student's weights from a run (here the teacher's own), the teacher's from
    distill.teacher: the state built for the given weights holds no teacher until the start hook loads it."""
    directory, weights = teacher
    config = write_config(tmp_path, directory, model=TEACHER_MODEL, train={"init_from": str(directory)})
    state = assert_teacher_loaded(config, weights)
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(weights)):
        np.testing.assert_array_equal(np.asarray(got), want)


# The trained run's learning rate (constant): the sharded run's 3 steps are also its first 3.
TRAINED_RATE = 3e-3


@pytest.fixture(scope="module")
def trained(tmp_path_factory, teacher):
    """The run directory of 8 steps of distillation on one device (eval every 4 steps, a checkpoint every 2)."""
    tmp_path = tmp_path_factory.mktemp("trained")
    config = write_config(tmp_path, teacher[0], train={"max_steps": 8}, optimizer={"learning_rate": TRAINED_RATE})
    assert main(["train", str(config)]) == 0
    return tmp_path / "run"


def metrics(run_dir) -> list[dict]:
    """The lines of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_distillation_run_trains_and_logs_its_terms(trained, teacher):
    lines = metrics(trained)
    train = [line for line in lines if line["split"] == "train"]
    evaluation = [line for line in lines if line["split"] == "eval"]
    assert train[-1]["loss"] < train[0]["loss"]
    for line in train:
        np.testing.assert_allclose(line["loss"], 0.5 * line["distill"] + 0.5 * line["cross_entropy"], rtol=1e-5)
    assert evaluation and evaluation[-1]["loss"] == evaluation[-1]["cross_entropy"] and evaluation[-1]["distill"] > 0
    recorded = yaml.safe_load((trained / "config.yaml").read_text())
    assert recorded["task"] == "distill" and recorded["distill"]["teacher"] == str(teacher[0])


def test_an_hf_teacher_directory(tmp_path):
    """A teacher of another architecture, given as an HF directory (a GPT-2 here, the student a functrain GPT)."""
    from functrain.models.gpt2 import GPT2Config
    from torch_bridge.hf import save_pretrained
    model = {"name": "gpt2", "vocab_size": 256, "n_positions": 16, "n_embd": 16, "n_layer": 1, "n_head": 2}
    hf_module = build_model(GPT2Config(**model))
    params = jax.tree.map(np.asarray, nn.meta.unbox(
        jax.jit(hf_module.init)(jax.random.PRNGKey(2), np.zeros((1, 8), np.int32))["params"]))
    save_pretrained(params, GPT2Config(**model), tmp_path / "hf")
    assert_teacher_loaded(write_config(tmp_path, tmp_path / "hf"), params)


@pytest.mark.parametrize("case, expected", [
    ("vocabulary", "has a vocabulary of 300 tokens and the student 256"),
    ("no_checkpoint", "holds no checkpoint"),
    ("section_without_task", "the distill section configures task distill and this config trains"),
    ("torch", "task distill runs on backend jax; set backend=jax"),
    ("no_teacher", "task distill needs a teacher; set distill.teacher"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, teacher, case, expected):
    directory = teacher[0]
    sections = {}
    if case == "vocabulary":
        directory = tmp_path / "wide"
        write_teacher(directory, {**TEACHER_MODEL, "vocab_size": 300})
    elif case == "no_checkpoint":
        directory = tmp_path / "untrained"
        directory.mkdir()
        (directory / "config.yaml").write_text(yaml.safe_dump({"model": TEACHER_MODEL}))
    elif case == "section_without_task":
        sections["task"] = None
    config = write_config(tmp_path, directory, **sections)
    raw = yaml.safe_load(config.read_text())
    if case == "torch":
        raw["backend"] = "torch"
    if case == "no_teacher":
        raw["distill"].pop("teacher")
    config.write_text(yaml.safe_dump(raw))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("functrain: error:") and expected in err and "\n" not in err, err
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"


def test_the_teacher_is_sharded_by_its_logical_axes(tmp_path, teacher, trained):
    """On 4 devices (fsdp 2 x tensor 2) the teacher's weights are sharded by their own logical axes (no student
    weight has their shapes) and the run's losses are those of one device (the trained run's first 3 steps)."""
    config = write_config(tmp_path, teacher[0], train={"max_steps": 3, "steps_per_call": 1},
                          optimizer={"learning_rate": TRAINED_RATE}, eval={"every_steps": 0},
                          checkpoint={"every_steps": 0})
    code = f"""
        import json
        from functrain.commands.cli import main
        from functrain.run.build import build_run
        from functrain.config.load import load_config
        mesh = ["mesh.fsdp=2", "mesh.tensor=2", "run.dir={tmp_path / 'sharded'}"]
        teacher = build_run(load_config({str(config)!r}, mesh)).backend.state_shardings.model_state["teacher"]
        print(json.dumps([list(teacher["params"]["token_embed"]["embedding"].spec),
                          list(teacher["params"]["block_0"]["mlp_in"]["kernel"].spec)]))
        assert main(["train", {str(config)!r}, *mesh]) == 0
    """
    sharded = run_python(code, devices=4)
    assert json.dumps([["tensor", "fsdp"], ["fsdp", "tensor"]]) in sharded.stdout.splitlines()

    def losses(run_dir):
        return [(line["loss"], line["distill"]) for line in metrics(run_dir) if line["split"] == "train"]
    assert len(losses(tmp_path / "sharded")) == 3
    np.testing.assert_allclose(losses(tmp_path / "sharded"), losses(trained)[:3], atol=1e-5, rtol=0)
