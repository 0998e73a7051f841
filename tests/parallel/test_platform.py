"""Without a TPU attached, processes start only the platforms the machine has: no libtpu burst on stderr and no
libtpu start-up time, even with the tpu extra installed; a JAX_PLATFORMS the user set wins."""

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from functrain.parallel import platform
from tests.conftest import REPO_ROOT

LIBTPU_MARKERS = ("libtpu", "TPU_", "InitGoogle", "tpu")


def test_no_tpu_device_nodes_means_cpu(monkeypatch):
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    assert platform.platforms_without_tpu() == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    platform.choose_platforms()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_an_attached_tpu_leaves_the_choice_to_jax(monkeypatch):
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: ["/dev/accel0"] if "accel" in pattern else [])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    platform.choose_platforms()
    assert "JAX_PLATFORMS" not in os.environ


def test_a_script_that_imported_jax_first_gets_the_choice_through_jax_config(monkeypatch):
    updates = []
    config = SimpleNamespace(jax_platforms=None, update=lambda name, value: updates.append((name, value)))
    monkeypatch.setitem(sys.modules, "jax", SimpleNamespace(config=config))
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    platform.choose_platforms()
    assert updates == [("jax_platforms", "cpu")]


def test_libtpu_is_told_the_topologys_accelerator_type_where_no_tpu_is_attached(monkeypatch):
    for name in ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(platform.glob, "glob", lambda pattern: [])
    platform.describe_host_to_libtpu("v5p:4x4x8")
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5p-256" and os.environ["TPU_WORKER_HOSTNAMES"] == "localhost"
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    platform.describe_host_to_libtpu("v5e:4x4")  # a value already set wins
    assert os.environ["TPU_ACCELERATOR_TYPE"] == "v5litepod-16"


def test_a_user_setting_wins(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,tpu")
    platform.choose_platforms()
    assert os.environ["JAX_PLATFORMS"] == "cpu,tpu"


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu extra is not installed")
@pytest.mark.skipif(bool(platform.platforms_without_tpu() is None), reason="a TPU is attached")
def test_functrain_train_prints_no_libtpu_lines(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, "-m", "functrain", "train", "configs/mlp_digits.yaml",
                           f"run.dir={tmp_path / 'r'}", "train.max_steps=2", "train.steps_per_call=1",
                           "log.every_steps=1", "model.hidden=[8]", "data.eval_fraction=0", "eval.every_steps=0",
                           "checkpoint.every_steps=0", "log.progress=false"],
                          capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    noisy = [line for line in proc.stderr.splitlines() if any(marker in line for marker in LIBTPU_MARKERS)]
    assert noisy == []


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="the tpu extra is not installed")
@pytest.mark.skipif(bool(platform.platforms_without_tpu() is None), reason="a TPU is attached")
@pytest.mark.parametrize("topology, libtpus_reason", [
    ("v9x:2x2", "Invalid TPU external name: TPU v9x"),
    ("v5p:abc", "Your TPU topology name v5p:abc is invalid"),
])
def test_a_bad_topology_is_our_one_line_with_no_libtpu_line_before_it(topology, libtpus_reason):
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    proc = subprocess.run([sys.executable, "-m", "functrain", "plan", "configs/mlp_digits.yaml", "--topology",
                           topology], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300)
    assert proc.returncode == 2
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"functrain: error: unknown TPU topology {topology!r} (INVALID_ARGUMENT: {libtpus_reason}")
