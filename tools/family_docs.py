"""The docs' lists and table of model families, rendered from the families functrain ships (their declarations,
:mod:`functrain.models`; an installed plugin's are not the docs').

A list is written between markers, ``<!-- families: SELECTOR -->`...`<!-- /families -->``, where SELECTOR is
``all`` or capabilities (:data:`functrain.models.family.CAPABILITIES`) a family must have, ``!capability`` one it
must not, separated by spaces; the table of every family and what it can do between ``<!-- family-table -->``
and ``<!-- /family-table -->``. ``python tools/family_docs.py`` lists the files whose marked text is stale
(``tests/models/test_family_docs.py`` holds the docs to it); ``--write`` rewrites them.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from functrain.models import collect_families, declared_families  # noqa: E402
from functrain.models.family import Family  # noqa: E402
from tools import doc_markers  # noqa: E402

LIST = re.compile(r"(<!-- families: (?P<selector>[a-z_! ]+) -->)(?P<body>.*?)(<!-- /families -->)", re.S)
TABLE = re.compile(r"(<!-- family-table -->\n)(?P<body>.*?)(<!-- /family-table -->)", re.S)
# The table's columns after the name: heading, and what a family shows in it.
COLUMNS = {
    "kind": lambda family: family.kind,
    "HF `model_type`": lambda family: ", ".join(f"`{model_type}`" for model_type in family.hf_model_types),
    "`scan_layers`": lambda family: _mark(family.scans_layers),
    "`mesh.context`": lambda family: _mark(family.context_parallel),
    "`mesh.pipeline`": lambda family: _mark(family.pipeline),
    "`mesh.expert`": lambda family: _mark(family.expert_parallel),
    "KV-cache decoding": lambda family: _mark(family.generation_cache),
    "torch twin": lambda family: _mark(family.torch_twin is not None),
}


def _mark(capable: bool) -> str:
    return "yes" if capable else ""


def _selected(family: Family, selector: str) -> bool:
    terms = selector.split()
    return all(term == "all" or family.can(term.lstrip("!")) != term.startswith("!") for term in terms)


def shipped() -> dict[str, Family]:
    """The families functrain ships, by name (sorted)."""
    return dict(collect_families(declared_families()))


def family_list(selector: str) -> str:
    """The families ``selector`` picks, as the docs write them: ```a`, `b`, `c```."""
    return ", ".join(f"`{name}`" for name, family in shipped().items() if _selected(family, selector))


def family_table() -> str:
    """Every family and what it can do, as a markdown table."""
    rows = [["`model.name`", *COLUMNS], ["---"] * (len(COLUMNS) + 1)]
    rows += [[f"`{name}`", *(cell(family) for cell in COLUMNS.values())] for name, family in shipped().items()]
    return "".join(f"| {' | '.join(row)} |\n" for row in rows)


def rendered(text: str) -> str:
    """``text`` with every marked list and table rendered from the registry."""
    text = LIST.sub(lambda m: m.group(1) + family_list(m.group("selector")) + m.group(4), text)
    return TABLE.sub(lambda m: m.group(1) + family_table() + m.group(3), text)


def stale() -> list[Path]:
    """The documents whose marked lists or tables differ from the registry's."""
    return doc_markers.stale(rendered)


if __name__ == "__main__":
    sys.exit(doc_markers.main(rendered, "families"))
