"""The docs' lists and table of tasks, rendered from the tasks functrain ships (their folders' declarations,
:mod:`functrain.tasks`; an installed plugin's are not the docs').

A list is written between markers, ``<!-- tasks: SELECTOR -->`...`<!-- /tasks -->``, where SELECTOR is ``all``
or what a task must have (``section``: a config section of its own), ``!section`` what it must not, separated by
spaces; the table of every task, its folder and what it trains between ``<!-- task-table -->`` and
``<!-- /task-table -->``. The table's last column is prose: rendering keeps each task's, drops a row whose task is
gone and adds a row with an empty description for a new task (``tests/tasks/test_task_docs.py`` refuses an
empty one). ``python tools/task_docs.py`` lists the files whose marked text is stale; ``--write`` rewrites them.
"""

import re
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from functrain.tasks import declarations  # noqa: E402
from functrain.tasks.declaration import TaskDeclaration  # noqa: E402
from tools import doc_markers  # noqa: E402

LIST = re.compile(r"(<!-- tasks: (?P<selector>[a-z_! ]+) -->)(?P<body>.*?)(<!-- /tasks -->)", re.S)
TABLE = re.compile(r"(<!-- task-table -->\n)(?P<body>.*?)(<!-- /task-table -->)", re.S)
HEADER = "| `task:` | folder | what it trains |\n|---|---|---|\n"
# What a selector may ask of a task.
HAS: dict[str, Callable[[TaskDeclaration], bool]] = {
    "all": lambda declaration: True,
    "section": lambda declaration: declaration.section is not None,
}
SHIPPED_PREFIX = "functrain.tasks."


def shipped() -> dict[str, TaskDeclaration]:
    """The tasks functrain ships (declared by its task folders), by name (sorted)."""
    return {
        name: declaration
        for name, declaration in sorted(declarations().items())
        if declaration.module.startswith(SHIPPED_PREFIX)
    }


def folder(declaration: TaskDeclaration) -> str:
    """The task's folder under ``functrain/tasks/``: ``supervised`` for ``functrain.tasks.supervised.task``."""
    return declaration.module[len(SHIPPED_PREFIX) :].split(".")[0]


def _selected(declaration: TaskDeclaration, selector: str) -> bool:
    for term in selector.split():
        wanted = term.lstrip("!")
        if wanted not in HAS:
            raise ValueError(f"unknown task selector {wanted!r} in a docs marker; choose from {', '.join(HAS)}")
        if HAS[wanted](declaration) == term.startswith("!"):
            return False
    return True


def task_list(selector: str) -> str:
    """The tasks ``selector`` picks, as the docs write them: ```a`, `b`, `c```."""
    return ", ".join(f"`{name}`" for name, declaration in shipped().items() if _selected(declaration, selector))


def descriptions(table: str) -> dict[str, str]:
    """What each row of a rendered task table says the task trains, by task name."""
    rows = [line.strip().strip("|").split(" | ", 2) for line in table.splitlines()[2:] if line.strip()]
    return {row[0].strip(" `"): row[2].strip() for row in rows if len(row) == 3}


def task_table(described: dict[str, str]) -> str:
    """Every shipped task, its folder and what ``described`` says it trains, as a markdown table."""
    rows = [f"| `{name}` | `{folder(entry)}/` | {described.get(name, '')} |" for name, entry in shipped().items()]
    return HEADER + "".join(f"{row}\n" for row in rows)


def rendered(text: str) -> str:
    """``text`` with every marked list and table rendered from the registry."""
    text = LIST.sub(lambda m: m.group(1) + task_list(m.group("selector")) + m.group(4), text)
    return TABLE.sub(lambda m: m.group(1) + task_table(descriptions(m.group("body"))) + m.group(3), text)


def stale() -> list[Path]:
    """The documents whose marked lists or tables differ from the registry's."""
    return doc_markers.stale(rendered)


if __name__ == "__main__":
    sys.exit(doc_markers.main(rendered, "tasks"))
