"""What the docs' marked text shares: the documents that may hold it (the README and docs/), and

- for the rendered lists (tools/family_docs.py, tools/task_docs.py): which documents a renderer would change, and
  the script that reports or rewrites them;
- for the commands (tests/commands/test_readme.py): the fenced blocks, a block without a language (or ``sh``) being
  shell commands that a test checks unless ``<!-- illustrative: WHY -->`` on the line above it says why not (a
  synopsis with placeholders, a config of the reader's own); a block that is no command has a language (``text``
  for output, ``json``, ``yaml``, ``python``).
"""

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?:<!-- illustrative: (?P<why>[^\n]+?) -->\n)?```(?P<language>\w*)\n(?P<body>.*?)^```\n", re.S | re.M)
SHELL = ("", "sh")  # the languages of blocks of commands


@dataclass(frozen=True)
class FencedBlock:
    """A fenced block of a document: its language, its text and, for commands not checked, why (the marker)."""

    language: str
    body: str
    illustrative: str | None

    @property
    def checked(self) -> bool:
        """Shell commands that a test checks."""
        return self.language in SHELL and self.illustrative is None


def fenced_blocks(text: str) -> list[FencedBlock]:
    """The fenced blocks of a document's ``text``, in order."""
    return [FencedBlock(m.group("language"), m.group("body"), m.group("why")) for m in FENCE.finditer(text)]


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
