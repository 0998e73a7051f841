"""The docs' lists and table of tasks agree with the task folders' declarations (tools/task_docs.py renders them;
``python tools/task_docs.py --write`` brings them up to date)."""

import re

import pytest

from tools import doc_markers, task_docs

# Where the docs list tasks, and which: a list that left its document would no longer be checked.
EXPECTED_LISTS = {
    "README.md": ["all"],
    "docs/config.md": ["all", "section"],
    "docs/moe.md": ["all"],
    "docs/tasks.md": ["section"],
}
TASKS_DIR = doc_markers.ROOT / "functrain" / "tasks"


def test_the_docs_lists_and_table_of_tasks_are_the_registry_s():
    assert task_docs.stale() == [], "run: python tools/task_docs.py --write"
    lists = {}
    for path in doc_markers.documents():
        selectors = [match.group("selector") for match in task_docs.LIST.finditer(path.read_text())]
        if selectors:
            lists[str(path.relative_to(doc_markers.ROOT))] = selectors
    assert lists == EXPECTED_LISTS
    table = task_docs.TABLE.search((doc_markers.ROOT / "docs" / "tasks.md").read_text()).group("body")
    described = task_docs.descriptions(table)
    assert list(described) == list(task_docs.shipped())
    undescribed = [name for name, text in described.items() if not text]
    assert undescribed == [], f"describe {undescribed} in docs/tasks.md's table (what it trains)"
    # Every task folder of the package is in the docs (a folder is a task by being there).
    folders = {path.parent.name for path in TASKS_DIR.glob("*/__init__.py")}
    assert {task_docs.folder(entry) for entry in task_docs.shipped().values()} == folders


def test_the_readme_layout_names_every_task_folder():
    readme = (doc_markers.ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `functrain/tasks/` |"))
    named = set(re.findall(r"`(\w+)/`", row))
    assert {task_docs.folder(entry) for entry in task_docs.shipped().values()} <= named


def test_a_list_or_table_that_leaves_the_registry_is_found_stale():
    text = "Modes: <!-- tasks: all -->`classify`, `causal_lm`, `preference`, `distill`<!-- /tasks -->."
    assert task_docs.rendered(text) == (
        "Modes: <!-- tasks: all -->`causal_lm`, `classify`, `distill`, `grpo`, `preference`<!-- /tasks -->."
    )
    assert task_docs.task_list("!section") == "`causal_lm`, `classify`"
    with pytest.raises(ValueError, match="unknown task selector 'settings'"):
        task_docs.task_list("settings")
    # A row for a task that is gone is dropped; a task without a row gets one, with its folder and no description.
    table = (
        "<!-- task-table -->\n" + task_docs.HEADER + "| `classify` | `supervised/` | a classifier |\n"
        "| `ranking` | `ranking/` | a ranker |\n<!-- /task-table -->"
    )
    rows = task_docs.rendered(table).splitlines()[3:-1]
    assert rows[1] == "| `classify` | `supervised/` | a classifier |"
    assert rows[3] == "| `grpo` | `grpo/` |  |"
    assert not any("ranking" in row for row in rows)
    assert [row.split(" | ")[0].strip("| `") for row in rows] == list(task_docs.shipped())
