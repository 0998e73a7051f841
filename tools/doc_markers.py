"""What the docs' rendered lists share (tools/family_docs.py, tools/task_docs.py): the documents that may hold
marked text, which of them a renderer would change, and the script that reports or rewrites them."""

import sys
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent


def documents() -> list[Path]:
    """The files that may hold marked lists: the README and docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def stale(rendered: Callable[[str], str]) -> list[Path]:
    """The documents whose marked text ``rendered`` would change."""
    return [path for path in documents() if rendered(path.read_text()) != path.read_text()]


def main(rendered: Callable[[str], str], what: str) -> int:
    """The scripts' command line: list the stale documents (exit 1 if any), or rewrite them with ``--write``."""
    if "--write" in sys.argv[1:]:
        for path in stale(rendered):
            path.write_text(rendered(path.read_text()))
            print(f"rewrote {path.relative_to(ROOT)}")
        return 0
    out_of_date = stale(rendered)
    print("\n".join(f"stale: {path.relative_to(ROOT)}" for path in out_of_date) or f"the docs' {what} are current")
    return 1 if out_of_date else 0
