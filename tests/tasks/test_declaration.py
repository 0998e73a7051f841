"""Tasks declare themselves where they live: a declaration missing something is refused in one line naming it, a
task folder without one too, and a plugin's broken entry point is named with the plugin; every list of tasks comes
from the declarations."""

from importlib.metadata import EntryPoint

import pytest

import functrain.tasks as tasks
from functrain.core.section import TaskSection
from functrain.errors import ConfigError
from functrain.tasks.declaration import DeclarationError, Panel, TaskDeclaration


@pytest.mark.parametrize("fields, expected", [
    ({"names": (), "module": "pkg.task"}, "the task declaration of pkg.task declares no names"),
    ({"names": ("a b",), "module": "pkg.task"}, "declares no names (names=(...) of identifiers)"),
    ({"names": ("mine",), "module": ""}, "task mine declares no module; declare module='package.module'"),
    ({"names": ("mine",), "module": "pkg.task", "section": dict}, "task mine declares section=<class 'dict'>, not a "
                                                                  "TaskSection subclass"),
    ({"names": ("mine",), "module": "pkg.task", "panels": (("loss", None, "loss"),)},
     "task mine declares panels that are not Panel(...)"),
    ({"names": ("mine",), "module": "pkg.task", "summary": (("loss", "lowest"),)},
     "task mine declares summary lines other than (metric, 'min' | 'max')"),
])
def test_a_declaration_missing_something_is_refused_in_one_line(fields, expected):
    with pytest.raises(DeclarationError) as refused:
        TaskDeclaration(**fields)
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_every_list_of_tasks_is_the_declarations(monkeypatch):
    declared, registered = tasks.declarations(), tasks._REGISTERED  # registered: research code's (another test's)
    assert tasks.task_names() == sorted({*declared, *registered})
    assert set(tasks.task_sections()) == {name for name, entry in declared.items() if entry.section is not None} | {
        name for name, (_, section) in registered.items() if section is not None}
    assert [panel.metric for panel in tasks.task_panels()] == [
        panel.metric for entry in dict.fromkeys(declared.values()) for panel in entry.panels]
    # A task declared by a plugin joins every list, and its section validates configs.
    class MineConfig(TaskSection):
        rate: float = 1.0

    mine = TaskDeclaration(("mine",), "pkg.mine", MineConfig, (Panel("mine", None, "mine/metric"),),
                           (("mine/metric", "max"),))
    monkeypatch.setattr(tasks, "_plugins", lambda: [mine])
    tasks.declarations.cache_clear()
    try:
        assert "mine" in tasks.task_names() and tasks.task_sections()["mine"] is MineConfig
        assert tasks.task_panels()[-1].metric == "mine/metric"
        assert ("mine/metric", "max") in tasks.task_summary_metrics()
        with pytest.raises(ValueError, match="task 'mine' is declared by pkg.mine; register yours under another name"):
            tasks.register_task(type("Mine", (), {"name": "mine"})())
    finally:
        tasks.declarations.cache_clear()


def test_a_task_declared_twice_is_refused(monkeypatch):
    monkeypatch.setattr(tasks, "_plugins", lambda: [TaskDeclaration(("grpo",), "pkg.grpo")])
    tasks.declarations.cache_clear()
    try:
        with pytest.raises(DeclarationError, match="task 'grpo' is declared by functrain.tasks.grpo.task and by "
                                                   "pkg.grpo; rename one"):
            tasks.declarations()
    finally:
        tasks.declarations.cache_clear()


def test_a_task_folder_without_a_declaration_is_refused(tmp_path, monkeypatch):
    folder = tmp_path / "undeclared"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""A task folder that forgot its DECLARATION."""\n')
    monkeypatch.setattr(tasks, "__path__", [*tasks.__path__, str(tmp_path)])
    with pytest.raises(DeclarationError) as refused:
        tasks._shipped()
    assert str(refused.value) == ("task folder functrain/tasks/undeclared declares no DECLARATION = "
                                  "TaskDeclaration(...) in its __init__.py; declare it")


@pytest.mark.parametrize("value, expected", [
    ("no_such_package.tasks:DECLARATION", "task plugin 'broken' (no_such_package.tasks:DECLARATION) does not load "
                                          "(ModuleNotFoundError: No module named 'no_such_package'); fix or "
                                          "uninstall the package that provides it"),
    ("functrain.tasks:ENTRY_POINTS", "task plugin 'broken' (functrain.tasks:ENTRY_POINTS) is a str, not a "
                                     "TaskDeclaration; point the entry point at one"),
])
def test_a_broken_plugin_is_named_in_one_line(monkeypatch, value, expected):
    point = EntryPoint(name="broken", value=value, group=tasks.ENTRY_POINTS)
    monkeypatch.setattr(tasks, "entry_points", lambda group: [point] if group == tasks.ENTRY_POINTS else [])
    with pytest.raises((ConfigError, DeclarationError)) as refused:
        tasks._plugins()
    assert str(refused.value) == expected
