"""The setup (`make train`, `make test` from a fresh clone) writes nothing outside .venv/ but pip's cache.

The editable install is what wrote into the checkout (setuptools' egg_info, run by an isolated build, left a
functrain.egg-info there): the Makefile's own options install a copy of the package here, dry, and the copy must stay
as it was. The test session's files (temporary files, the caches and settings of the libraries the tests use) are
under the session's folder, which tests/conftest.py removes at the end.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import REPO_ROOT, SESSION_DIR

MAKEFILE = (REPO_ROOT / "Makefile").read_text()


def _variable(name: str) -> str:
    return re.search(rf"^{name} := (.*)$", MAKEFILE, re.M).group(1)


def test_the_makefile_s_editable_install_writes_nothing_into_the_source_tree(tmp_path):
    editable = _variable("EDITABLE").split()
    for target in (r"\$\(VENV\)/\.core", r"\$\(VENV\)/\.dev"):  # both installs of the package use those options
        recipe = re.search(rf"^{target}:.*\n((?:\t.*\n)*)", MAKEFILE, re.M).group(1)
        assert re.search(r"\$\(INSTALL\) \$\(EDITABLE\) ", recipe), recipe
    assert re.search(r'^\t\$\(INSTALL\) --upgrade pip "setuptools>=77"', MAKEFILE, re.M)  # the backend, first
    source = tmp_path / "functrain-copy"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source)
    for package in ("functrain", "torch_bridge"):
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    before = sorted(path.relative_to(source) for path in source.rglob("*"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--no-deps", "--no-index",
                    *editable, str(source)], check=True, capture_output=True, timeout=300)
    assert sorted(path.relative_to(source) for path in source.rglob("*")) == before


def test_the_session_keeps_its_files_in_its_own_folder():
    for name in ("TMPDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "WANDB_CACHE_DIR"):
        assert Path(os.environ[name]).is_relative_to(SESSION_DIR), name
    assert Path(tempfile.gettempdir()).is_relative_to(SESSION_DIR)


def test_the_installer_passes_pip_s_options_on_to_uv(tmp_path, monkeypatch):
    """tools/install.py: uv reads no pip configuration, so the options pip would install with (its files and PIP_*
    variables, a variable winning over a file, as pip merges them) are passed on; a file:// index or find-links
    folder that does not exist is dropped (pip skips it; uv would stop), pip's certificate bundle goes to uv."""
    spec = importlib.util.spec_from_file_location("install", REPO_ROOT / "tools" / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nfind-links = /from/the/file\ncert = /etc/ca.pem\n")
    index = tmp_path / "simple"
    index.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    monkeypatch.setenv("PIP_FIND_LINKS", f"{tmp_path} {tmp_path}/absent")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"file://{tmp_path}/absent file://{index}")
    monkeypatch.setenv("PIP_CONSTRAINT", str(tmp_path / "constraints.txt"))
    for name in ("SSL_CERT_FILE", "PIP_CERT", "PIP_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    command, env = install.uv_command(["--editable", "."])
    passed = " ".join(command[command.index("unsafe-best-match") + 1:])
    assert f"--find-links {tmp_path} " in passed and "/from/the/file" not in passed
    assert f"--extra-index-url file://{index}" in passed and "absent" not in passed
    assert f"--constraint {tmp_path / 'constraints.txt'}" in passed and passed.endswith("--editable .")
    assert env["SSL_CERT_FILE"] == "/etc/ca.pem"
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert "--no-index" in install.uv_command([])[0]
