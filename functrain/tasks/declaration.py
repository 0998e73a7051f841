"""What a task declares where it lives: the names it trains under, the module of its code, its config section, the
panels its metrics add to a run's plot and the eval metrics its run's summary reports.

A task shipped with functrain declares it in its folder's ``__init__.py`` (``DECLARATION = TaskDeclaration(...)``),
a third-party package through the entry point group ``functrain.tasks`` (``name = "package.module:DECLARATION"``):
:mod:`functrain.tasks` collects both. Declarations are light: reading one imports the task's config section (a
pydantic model) and nothing of its code, so a config validates without importing the modes it does not train.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from functrain.core.section import TaskSection


class DeclarationError(ValueError):
    """A task (or family) declaration missing something it must declare; the message is one line naming it."""


@dataclass(frozen=True)
class Panel:
    """One panel of ``functrain plot``: its title, y label (None: the metric's name), the train metric it draws
    (or the first of several a run logs), whether eval values are drawn too and whether the curve is smoothed."""

    title: str
    label: str | None
    metric: str | tuple[str, ...]
    with_eval: bool = False
    smoothed: bool = True


@dataclass(frozen=True)
class TaskDeclaration:
    """A task as its folder (or a plugin package) declares it (see the module docstring).

    Attributes:
      names: the ``task:`` names it trains under (one Task object each, in ``module``'s ``TASKS`` dict).
      module: the module defining the Task objects, imported when a run trains one of them.
      section: its config section (the top-level key named after the task), or None for a task without settings.
      panels: plot panels of the metrics it logs, drawn when a run logs them.
      summary: ``(eval metric, "min" | "max")``: what the end-of-run summary reports, and which way is better.
    """

    names: tuple[str, ...]
    module: str
    section: type[TaskSection] | None = None
    panels: tuple[Panel, ...] = ()
    summary: tuple[tuple[str, Literal["min", "max"]], ...] = ()

    def __post_init__(self) -> None:
        where = f"the task declaration of {self.module or 'a task'}"
        if not self.names or not all(isinstance(name, str) and name.isidentifier() for name in self.names):
            raise DeclarationError(f"{where} declares no names (names=(...) of identifiers); declare the task's names")
        if not isinstance(self.module, str) or not self.module:
            raise DeclarationError(f"task {self.names[0]} declares no module; declare module='package.module'")
        if self.section is not None and not (isinstance(self.section, type) and issubclass(self.section, TaskSection)):
            raise DeclarationError(
                f"task {self.names[0]} declares section={self.section!r}, not a TaskSection subclass; declare its "
                f"config section class (functrain.core.section.TaskSection) or None"
            )
        if not all(isinstance(panel, Panel) for panel in self.panels):
            raise DeclarationError(
                f"task {self.names[0]} declares panels that are not Panel(...); declare Panel objects"
            )
        if not all(len(line) == 2 and line[1] in ("min", "max") for line in self.summary):
            raise DeclarationError(
                f"task {self.names[0]} declares summary lines other than (metric, 'min' | 'max'); declare those"
            )
