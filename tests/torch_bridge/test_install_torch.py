"""tools/install_torch.sh (the setup's PyTorch, CPU build where no GPU is present) leaves nothing behind."""

import os
import subprocess

from tests.conftest import REPO_ROOT

# An interpreter without torch whose pip finds the CPU wheel locally: it logs each call, and a pip that copied
# a wheel would have been asked to download it somewhere.
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
[ "$1" = "-c" ] && exit 1
exit 0
"""


def test_the_cpu_wheel_probe_installs_from_where_it_lies_and_leaves_no_file(tmp_path):
    python, calls, temp = tmp_path / "python", tmp_path / "calls", tmp_path / "tmp"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    temp.mkdir()
    env = {**os.environ, "CALLS": str(calls), "TMPDIR": str(temp), "PATH": "/usr/bin:/bin"}  # no nvidia-smi
    subprocess.run(["sh", str(REPO_ROOT / "tools" / "install_torch.sh"), str(python)], env=env, check=True)
    assert calls.read_text().splitlines() == [
        "-c import torch",
        "-m pip install --dry-run --quiet --no-deps --no-index torch==2.13.0",
        f"{REPO_ROOT / 'tools' / 'install.py'} torch==2.13.0",  # uv or pip, with pip's configuration
    ]
    assert list(temp.iterdir()) == []
