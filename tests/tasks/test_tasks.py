"""Tasks as plugins: the registry, the `task` key and its sections, the builder's fixed sequence, a task of
one's own (examples/regression_task.py)."""

import ast
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest
from functrain.commands.cli import main
from functrain.errors import ConfigError
from functrain.run.parts import build_parts
from functrain.config.load import load_config
from functrain.run.fit import fit
from functrain.tasks import _REGISTERED, register_task, task_for, task_names
from functrain.tasks.supervised.task import Supervised

REPO = Path(__file__).resolve().parents[2]
# Names a builder would branch on if modes were still branches: the tasks' and the built-in losses'.
MODE_NAMES = {*task_names(), "supervised", "classifier", "distill"}


def _mode_comparisons(path: Path) -> list[str]:
    """``x == "preference"``-like tests (and ``in`` tests against tuples of such names) in one file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        constants = [n.value for n in operands if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        constants += [e.value for n in operands if isinstance(n, (ast.Tuple, ast.List, ast.Set))
                      for e in n.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        found += [f"{path.relative_to(REPO)}:{node.lineno} {name!r}" for name in constants if name in MODE_NAMES]
    return found


def test_the_run_package_tests_no_task_name():
    run_files = sorted((REPO / "functrain" / "run").glob("*.py"))
    assert len(run_files) > 10
    assert [hit for path in run_files for hit in _mode_comparisons(path)] == []
    # The check sees such a test where one is written (a scan finding nothing anywhere would pass vacuously).
    probe = REPO / "functrain" / "core" / "fields.py"  # the built-in losses pick their fields by kind
    assert any("'classifier'" in hit for hit in _mode_comparisons(probe))


def _config(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "config.yaml"
    base = {"model": {"name": "mlp", "hidden": [8], "num_classes": 10}, "data": {"name": "digits"},
            "run": {"dir": str(tmp_path / "run")}, "train": {"max_steps": 2}, "log": {"progress": False}}
    path.write_text(yaml.safe_dump({**base, **sections}))
    return path


@pytest.mark.parametrize("sections, expected", [
    ({"task": "preferance"}, "unknown task 'preferance'; did you mean 'preference'?"),
    ({"preference": {"beta": 0.5}}, "the preference section configures task preference and this config trains a "
                                    "classifier or causal LM (no task set); set task: preference"),
    ({"task": "causal_lm"}, "task causal_lm trains a causal_lm and the model is a classifier; set task: classify"),
])
def test_bad_task_settings_are_one_line_exit_2_and_nothing_is_written(tmp_path, capsys, sections, expected):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    assert main(["train", str(_config(tmp_path, **sections))]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.jsonl"]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"


def test_the_task_is_named_or_implied():
    assert task_for(load_config(base={"model": {"name": "mlp"}})).name == "supervised"
    assert task_for(load_config(base={"model": {"name": "mlp"}, "task": "classify"})).name == "classify"
    implied = load_config(base={"model": {"name": "gpt"}, "data": {"name": "preference", "path": "p.jsonl"}})
    assert implied.task == "preference" and task_for(implied).name == "preference"
    assert "preference" not in load_config(base={"model": {"name": "mlp"}}).to_dict()  # only the task's own section
    assert "preference" in implied.to_dict()


def test_init_from_is_a_train_key_and_the_old_preference_key_an_alias():
    base = {"model": {"name": "gpt"}, "data": {"name": "preference", "path": "p.jsonl"}}
    assert load_config(base={**base, "preference": {"init_from": "runs/a"}}).train.init_from == "runs/a"
    assert load_config(base={**base, "train": {"init_from": "runs/a"}}).train.init_from == "runs/a"
    with pytest.raises(ConfigError, match="preference.init_from='runs/a' and train.init_from='runs/b' differ"):
        load_config(base={**base, "preference": {"init_from": "runs/a"}, "train": {"init_from": "runs/b"}})


def test_init_from_starts_any_task_from_another_runs_weights(tmp_path, capsys):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    assert main(["train", str(_config(tmp_path / "a"))]) == 0
    source = tmp_path / "a" / "run"
    source_step = max(int(p.name) for p in (source / "checkpoints").iterdir() if p.name.isdigit())
    assert build_parts(load_config(_config(tmp_path / "b"), [f"train.init_from={source}"])).task.name == "supervised"
    capsys.readouterr()
    assert main(["train", str(_config(tmp_path / "b")), f"train.init_from={source}", "train.max_steps=1",
                 "optimizer.learning_rate=1e-9"]) == 0
    said = capsys.readouterr().err  # the start-up lines and the summary name the source run and its step
    assert f"started from the weights of {source} at step {source_step} (train.init_from)" in said
    assert said.count(f"{source} at step {source_step}") == 2, said
    trained, started = sorted(_leaves(load_params(source))), sorted(_leaves(load_params(tmp_path / "b" / "run")))
    assert [path for path, _ in started] == [path for path, _ in trained]
    for (_, want), (_, got) in zip(trained, started):  # one step at a learning rate of 1e-9: the weights of run a
        np.testing.assert_allclose(got, want, atol=1e-6)


def _leaves(tree, prefix=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, prefix + (key,))
    else:
        yield prefix, tree


def test_a_task_of_ones_own_trains_through_fit_and_its_section_is_checked(tmp_path):
    from examples import regression_task
    result = regression_task.main(str(tmp_path / "run"), max_steps=60)
    assert result.step == 60
    lines = [yaml.safe_load(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    held_out = regression_task.diabetes()[1]["y"]
    knows_nothing = float(optax.huber_loss(held_out, delta=1.0).mean())  # predicting the mean (0) of the targets
    evals = [line["loss"] for line in lines if line["split"] == "eval"]
    assert evals[-1] < 0.6 * knows_nothing
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["task"] == "regression" and recorded["regression"] == {"loss": "huber", "delta": 1.0}
    with pytest.raises(ConfigError, match="unknown config key 'regression.delat'; did you mean 'regression.delta'"):
        load_config(base={"model": {"name": "mlp"}, "task": "regression", "regression": {"delat": 2.0}})


class PseudoLabels(Supervised):
    """A toy on-policy task: each step relabels a random half of its batch with the model's own current
    predictions (the experience stage), keyed by (seed, step); the keys it is called with are recorded."""

    def __init__(self):
        super().__init__("classify")
        self.name = "pseudo_labels"
        self.keys = []

    def experience(self, context, data, pieces):
        def stage(params, batch, key, step):
            self.keys.append(np.asarray(key).tobytes())
            predicted = jnp.argmax(context.model.apply({"params": params}, batch["x"]), -1)
            relabel = jax.random.bernoulli(key, 0.5, batch["y"].shape)
            return {**batch, "y": jnp.where(relabel, predicted, batch["y"]).astype(batch["y"].dtype)}
        return stage


def test_an_experience_stage_makes_each_steps_batch_and_resume_stays_bitwise(tmp_path):
    task = PseudoLabels()
    register_task(task)
    try:
        def run(name, steps):
            fit(_config(tmp_path, task="pseudo_labels"), **{"run.dir": str(tmp_path / name), "train.max_steps": steps,
                                                            "train.steps_per_call": 2, "checkpoint.every_steps": 2})
            return params_digest(load_params(tmp_path / name))
        whole = run("whole", 6)
        assert len(task.keys) == 6 and len(set(task.keys)) == 6  # one stage call per step, each with a key of its own
        keys, task.keys = task.keys, []
        run("cut", 4)
        assert run("cut", 6) == whole  # resumed at step 4: bitwise the run that never stopped
        assert task.keys == keys  # the same keys at the same steps
    finally:
        _REGISTERED.pop("pseudo_labels")


def test_a_stage_not_made_to_run_across_processes_is_refused_on_many_in_one_line(tmp_path, monkeypatch):
    # Its batch is this process's rows and its params are global: a plain stage would mix them up (GRPO's and
    # on-policy distillation's run across processes: tests/tasks/grpo/test_grpo_processes.py).
    from functrain.run.build import build_run
    task = PseudoLabels()
    register_task(task)
    try:
        monkeypatch.setattr(jax, "process_count", lambda: 2)
        with pytest.raises(ConfigError, match="task pseudo_labels makes its batches with an experience stage that "
                                              "runs on one process") as info:
            build_run(load_config(_config(tmp_path, task="pseudo_labels")))
        assert "\n" not in str(info.value) and not (tmp_path / "run").exists()
    finally:
        _REGISTERED.pop("pseudo_labels")
