"""Training modes as plugins: ``task:`` in a config -> a :class:`~functrain.tasks.base.Task`.

Each task lives in a folder of its own (``functrain/tasks/<name>/``) whose ``__init__.py`` declares it
(:class:`~functrain.tasks.declaration.TaskDeclaration`: its names, the module of its code, its config section, its
plot panels and summary lines); a folder of this package is registered by being here. A third-party package
registers its tasks through the entry point group ``functrain.tasks`` (``examples/plugin_package``), research code
at run time with :func:`register_task`. Every list of tasks (errors, docs) is derived from these declarations.

A task's code is imported on first use, so a run never imports the modes it does not train; its section (a top-level
key named after the task: ``preference:``, ``distill:``) is read with the config. A config without ``task`` trains
what it implies: a section's ``implied_by`` (``data.name: preference``), else the data's fields (a classifier or a
causal LM: the supervised task).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import pkgutil
from importlib.metadata import entry_points
from typing import Any

from functrain.core.section import TaskSection
from functrain.errors import ConfigError
from functrain.tasks.declaration import DeclarationError, Panel, TaskDeclaration

# The entry point group third-party packages declare their tasks under (values: a TaskDeclaration).
ENTRY_POINTS = "functrain.tasks"
# What a config naming no task trains (the data's fields decide between a classifier and a causal LM), and the
# declared task whose module defines it.
SUPERVISED = "supervised"
SUPERVISED_HOME = "classify"
# Tasks registered at run time (research code, examples/): name -> (task, section class or None).
_REGISTERED: dict[str, tuple[Any, type[TaskSection] | None]] = {}


def _shipped() -> list[TaskDeclaration]:
    """The declarations of this package's task folders (each folder's ``DECLARATION``)."""
    found = []
    for folder in pkgutil.iter_modules(__path__):
        if not folder.ispkg:
            continue
        package = importlib.import_module(f"{__name__}.{folder.name}")
        declaration = getattr(package, "DECLARATION", None)
        if not isinstance(declaration, TaskDeclaration):
            raise DeclarationError(
                f"task folder functrain/tasks/{folder.name} declares no DECLARATION = TaskDeclaration(...) in its "
                f"__init__.py; declare it"
            )
        found.append(declaration)
    return found


def _plugins() -> list[TaskDeclaration]:
    """The declarations third-party packages register under :data:`ENTRY_POINTS`; a plugin that fails to load, or
    whose object is not a TaskDeclaration, is one line naming it."""
    found = []
    for point in entry_points(group=ENTRY_POINTS):
        where = f"task plugin {point.name!r} ({point.value})"
        try:
            declaration = point.load()
        except Exception as exc:  # noqa: BLE001 -- whatever third-party code raises is reported in the plugin's line
            reason = (str(exc).strip().splitlines() or [""])[0]
            raise ConfigError(
                f"{where} does not load ({type(exc).__name__}: {reason}); fix or uninstall the package that provides it"
            ) from None
        if not isinstance(declaration, TaskDeclaration):
            raise DeclarationError(
                f"{where} is a {type(declaration).__name__}, not a TaskDeclaration; point the entry point at one"
            )
        found.append(declaration)
    return found


@functools.cache
def declarations() -> dict[str, TaskDeclaration]:
    """Every declared task by name: this package's folders, then the plugins' (a name declared twice is refused)."""
    by_name: dict[str, TaskDeclaration] = {}
    for declaration in [*_shipped(), *_plugins()]:
        for name in declaration.names:
            if name in by_name or name == SUPERVISED:
                raise DeclarationError(
                    f"task {name!r} is declared by {by_name[name].module if name in by_name else 'functrain'} and "
                    f"by {declaration.module}; rename one"
                )
            by_name[name] = declaration
    return by_name


def register_task(task: Any, section: type[TaskSection] | None = None) -> None:
    """Register ``task`` (a :class:`~functrain.tasks.base.Task`) under ``task.name``, with its config section
    class (a :class:`~functrain.core.section.TaskSection`, the top-level key named after the task) or None; a
    config naming it can be loaded from then on. A declared name is refused."""
    if task.name in declarations():
        raise ValueError(
            f"task {task.name!r} is declared by {declarations()[task.name].module}; register yours under another name"
        )
    _REGISTERED[task.name] = (task, section)


def task_names() -> list[str]:
    """Every registered task name."""
    return sorted([*declarations(), *_REGISTERED])


def task_sections() -> dict[str, type[TaskSection]]:
    """Each task's config section class by the task's name (the run config's top-level keys)."""
    declared = {name: entry.section for name, entry in declarations().items() if entry.section is not None}
    return {**declared, **{name: section for name, (_, section) in _REGISTERED.items() if section is not None}}


def task_panels() -> list[Panel]:
    """The plot panels every declared task adds (once each, in declaration order)."""
    unique = {id(entry): entry for entry in declarations().values()}
    return [panel for entry in unique.values() for panel in entry.panels]


def task_summary_metrics() -> list[tuple[str, str]]:
    """``(eval metric, "min" | "max")`` the declared tasks' summaries report (once each)."""
    unique = {id(entry): entry for entry in declarations().values()}
    return list(dict.fromkeys(line for entry in unique.values() for line in entry.summary))


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
    declared = declarations().get(SUPERVISED_HOME if name == SUPERVISED else name)
    if declared is None:
        raise ConfigError(f"unknown task {name!r}; choose one of {', '.join(task_names())}")
    return importlib.import_module(declared.module).TASKS[name]
