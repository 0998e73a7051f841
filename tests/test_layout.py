"""The folders read as the architecture: every import points down the floors of tools/layers.py."""

import subprocess
import sys

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
