"""run.compile_cache: where the persistent cache goes, and a rerun that loads its train step instead of compiling."""

import json
import logging
import socket

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from functrain import fit
from functrain.run import compile_cache
from tests.conftest import SESSION_XLA_CACHE

TINY = {"train.max_steps": 4, "train.epochs": None, "train.steps_per_call": 2, "log.every_steps": 2,
        "log.progress": False, "log.tensorboard": False, "eval.every_steps": 0, "checkpoint.every_steps": 0}


@pytest.fixture
def session_cache_back():
    """Whatever a test points JAX's cache at, the session's cache is in place again afterwards."""
    yield
    jax.config.update("jax_compilation_cache_dir", str(SESSION_XLA_CACHE))
    compilation_cache.reset_cache()


def test_the_default_is_per_host_under_the_users_cache_and_a_jax_setting_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_directory() == tmp_path / "functrain" / "xla" / socket.gethostname()
    # The suite points JAX at its session cache (JAX_COMPILATION_CACHE_DIR): `auto` and null keep it.
    assert compile_cache.enable("auto") == SESSION_XLA_CACHE
    assert compile_cache.enable(None) == SESSION_XLA_CACHE
    assert jax.config.jax_compilation_cache_dir == str(SESSION_XLA_CACHE)
    assert not (tmp_path / "functrain").exists()


def test_a_directory_that_cannot_be_made_is_a_warning(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="functrain"):
        assert compile_cache.enable(str(tmp_path / "file" / "cache")) is None
    assert "cannot be created" in caplog.text and "compiling without it" in caplog.text
    assert jax.config.jax_compilation_cache_dir == str(SESSION_XLA_CACHE)


def test_a_rerun_loads_the_train_step_from_the_cache(tmp_path, caplog, session_cache_back):
    cache = tmp_path / "cache"
    settings = {**TINY, "run.dir": str(tmp_path / "run"), "run.compile_cache": str(cache)}
    with caplog.at_level(logging.INFO, logger="functrain"):
        fit("configs/mlp_digits.yaml", **settings)
        first = caplog.text
        caplog.clear()
        fit("configs/mlp_digits.yaml", **{**settings, "train.max_steps": 8})
    assert "train step compiled in" in first and f"compilation cache: {cache}" in first
    assert f"train step: compilation cache hit in {cache}" in caplog.text and any(cache.iterdir())
    # Both sessions are in events.jsonl with their seconds; the summary reports the run's goodput.
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    sessions = [e for e in events if e["event"] != "progress"]
    assert [e["event"] for e in sessions] == ["start", "end", "resume", "end"]
    assert sessions[2]["source"] == "persistent" and 0 <= sessions[2]["seconds"]["startup"] < 5
    assert "over 2 session(s)" in caplog.text and "session 2: resumed from step 4 (persistent)" in caplog.text
