"""The folders read as the architecture: every import points down the floors of tools/layers.py."""

import subprocess
import sys
from pathlib import Path

from tools import layers


def test_no_import_points_upward():
    edges = layers.arrows()
    assert ("run", "core") in edges  # the scan sees real imports (an empty graph would pass vacuously)
    assert layers.upward(edges) == []


def test_an_upward_import_is_reported():
    assert layers.upward({("core", "run"): ["functrain/core/step.py"]}) == ["core -> run (functrain/core/step.py)"]


def test_import_functrain_imports_no_torch_nor_lm_eval():
    code = ("import sys, functrain, functrain.run.build, functrain.run.loop; "
            "print('torch' in sys.modules, 'lm_eval' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False False"


def test_tests_mirror_the_package():
    """A module's tests are found by its path: every test file sits in the folder of the package it tests
    (tests/run/ for functrain/run/, tests/torch_bridge/hf/ for torch_bridge/hf/), and only the layering check,
    which is about the whole tree, sits at the top."""
    tests = layers.ROOT / "tests"
    folders = {path.parent.relative_to(tests) for path in tests.rglob("test_*.py")}
    assert len(folders) > 10
    for folder in sorted(folders):
        if folder.parts == ():
            assert sorted(p.name for p in tests.glob("test_*.py")) == ["test_layout.py"]
            continue
        package = layers.ROOT / ("torch_bridge" if folder.parts[0] == "torch_bridge" else "functrain") / Path(
            *folder.parts[1:] if folder.parts[0] == "torch_bridge" else folder.parts)
        assert package.is_dir() and any(package.glob("*.py")), f"tests/{folder} mirrors no package folder"


def test_the_modules_started_first_exist():
    # conftest.LONGEST_MODULES orders the suite for its two workers: a renamed module would silently go last.
    from tests.conftest import LONGEST_MODULES

    tests = Path(__file__).parent
    assert [module for module in LONGEST_MODULES if not (tests / module).is_file()] == []
