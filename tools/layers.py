"""The package's floors, and every import (module-level or inside a function) that points upward.

``python tools/layers.py`` prints the folder-to-folder arrows and any that break the order; the test
``tests/test_layout.py`` holds the code to it. A folder may import its own floor and any floor below.
"""

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Highest first: a room imports only rooms on its own floor or below.
FLOORS = [("commands",), ("plan",), ("run",), ("report",), ("callbacks",), ("config", "guards"), ("tasks",),
          ("text", "torch_bridge"), ("checkpoint",), ("models",), ("parallel",), ("core",), ("data",), ("errors",)]
LEVEL = {room: len(FLOORS) - index for index, rooms in enumerate(FLOORS) for room in rooms}


def room_of(module: str) -> str | None:
    """``functrain.run.loop`` -> ``run``; ``torch_bridge.hf.convert`` -> ``torch_bridge``; the package roots
    (``functrain``, ``functrain.__main__``) have no room: they sit above everything."""
    parts = module.split(".")
    if parts[0] == "torch_bridge":
        return "torch_bridge"
    if parts[0] != "functrain" or len(parts) < 2 or parts[1] in ("__init__", "__main__"):
        return None
    return parts[1]


def imports_of(path: Path) -> list[str]:
    """Every functrain/torch_bridge module ``path`` imports, at any depth of the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            base = node.module
            found += [f"{base}.{alias.name}" for alias in node.names] if base in ("functrain",) else [base]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.split(".")[0] in ("functrain", "torch_bridge")]


def arrows() -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> the files that import across, for rooms that differ."""
    edges: dict[tuple[str, str], list[str]] = defaultdict(list)
    for package in ("functrain", "torch_bridge"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            source = room_of(module)
            for target in map(room_of, imports_of(path)):
                if source and target and source != target:
                    edges[(source, target)].append(str(path.relative_to(ROOT)))
    return edges


def upward(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """The arrows that point to a higher floor (or to a room no floor lists)."""
    bad = []
    for (source, target), files in sorted(edges.items()):
        if source not in LEVEL or target not in LEVEL or LEVEL[target] > LEVEL[source] or (
                LEVEL[target] == LEVEL[source]):
            bad.append(f"{source} -> {target} ({', '.join(sorted(set(files)))})")
    return bad


if __name__ == "__main__":
    edges = arrows()
    for (source, target), files in sorted(edges.items()):
        print(f"{source:>12} -> {target:<12} {len(files)}")
    bad = upward(edges)
    print("\n".join(["upward:", *bad]) if bad else "no upward arrows")
    sys.exit(1 if bad else 0)
