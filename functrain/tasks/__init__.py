"""Training modes as plugins: ``task:`` in a config -> a :class:`~functrain.tasks.base.Task`.

Each task lives in a folder of its own (``functrain/tasks/<name>/``) and registers here by name, like a model
family: the module that defines it (imported on first use, so a run never imports the modes it does not train)
and, for a task with settings, the light module of its config section, a top-level key named after the task
(``preference:``, ``distill:``). A config without ``task`` trains what it implies: a section's ``implied_by``
(``data.name: preference``), else the data's fields (a classifier or a causal LM: the supervised task).
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from functrain.core.section import TaskSection
from functrain.errors import ConfigError

# name -> the module whose ``TASKS`` dict holds it.
TASK_MODULES = {
    "classify": "functrain.tasks.supervised.task",
    "causal_lm": "functrain.tasks.supervised.task",
    "preference": "functrain.tasks.preference.task",
    "distill": "functrain.tasks.distill.task",
    "grpo": "functrain.tasks.grpo.task",
}
# name -> the module whose ``SECTION`` is the task's config section (tasks with settings only).
SECTION_MODULES = {
    "preference": "functrain.tasks.preference.config",
    "distill": "functrain.tasks.distill.config",
    "grpo": "functrain.tasks.grpo.config",
}
# What a config naming no task trains (the data's fields decide between a classifier and a causal LM).
SUPERVISED = "supervised"
# Tasks registered at run time (research code, examples/): name -> (task, section class or None).
_REGISTERED: dict[str, tuple[Any, type[TaskSection] | None]] = {}


def register_task(task: Any, section: type[TaskSection] | None = None) -> None:
    """Register ``task`` (a :class:`~functrain.tasks.base.Task`) under ``task.name``, with its config section
    class (a :class:`~functrain.core.section.TaskSection`, the top-level key named after the task) or None; a
    config naming it can be loaded from then on. A name the package ships is refused."""
    if task.name in TASK_MODULES:
        raise ValueError(f"task {task.name!r} ships with functrain; register yours under another name")
    _REGISTERED[task.name] = (task, section)


def task_names() -> list[str]:
    """Every registered task name."""
    return sorted([*TASK_MODULES, *_REGISTERED])


def task_sections() -> dict[str, type[TaskSection]]:
    """Each task's config section class by the task's name (the run config's top-level keys)."""
    shipped = {name: importlib.import_module(module).SECTION for name, module in SECTION_MODULES.items()}
    return {**shipped, **{name: section for name, (_, section) in _REGISTERED.items() if section is not None}}


def check_task_name(name: str) -> str:
    """``name`` when registered; otherwise a ValueError naming the nearest one and the list."""
    if name not in task_names():
        close = difflib.get_close_matches(name, task_names(), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown task {name!r}; {hint}choose one of {', '.join(task_names())}")
    return name


def implied_task(config: Any) -> str | None:
    """The task a config trains when it names none: the first section whose ``implied_by`` holds, else None
    (the supervised task, decided by the data's fields)."""
    return next((name for name, section in task_sections().items() if section.implied_by(config)), None)


def task_for(config: Any) -> Any:
    """The :class:`~functrain.tasks.base.Task` a validated config trains."""
    name = config.task or SUPERVISED
    if name in _REGISTERED:
        return _REGISTERED[name][0]
    module = TASK_MODULES.get(name, TASK_MODULES["classify"] if name == SUPERVISED else None)
    if module is None:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(task_names())}")
    return importlib.import_module(module).TASKS[name]
