"""Local checkpoints: a step restores bitwise unless damaged or of another history of the run directory; which
step all processes agree on; an unwritable or full local disk; the config's refusals.

The real-process story (a 2-process job SIGKILLed after a local save, one process's local copy gone, restarted
by the supervisor, restored from its own copy and a peer's, bitwise) is in tests/run/test_multiprocess.py,
where it shares the uninterrupted reference runs.
"""

import errno
import logging

import jax
import numpy as np
import pytest

from functrain import fit
from functrain.checkpoint import local as local_module
from functrain.checkpoint.local import LocalCheckpoints
from functrain.checkpoint.local_restore import _choose, restore_local
from functrain.commands import cli
from functrain.config.load import load_config
from functrain.errors import ConfigError

TINY = {"train.max_steps": 20, "train.epochs": None, "train.steps_per_call": 5, "log.every_steps": 5,
        "eval.every_steps": 0, "log.progress": False, "log.tensorboard": False, "checkpoint.every_steps": 0}

def _state():
    return {"params": {"w": jax.numpy.arange(6.0).reshape(2, 3) - 3.0}, "state": {"step": jax.numpy.int32(7)}}


def _targets(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_a_step_restores_bitwise_unless_damaged_or_of_another_history(tmp_path, caplog):
    state = _state()
    local = LocalCheckpoints(tmp_path, tmp_path / "run", keep=2, history=lambda: 1.0)
    for step in (5, 10):
        local.save(step, state, {"step": step})
    local.wait()
    items, meta, step, source = restore_local(local, _targets(state), newest_persistent=5)
    assert (step, source, meta) == (10, "local", {"step": 10})
    assert np.asarray(items["params"]["w"]).tobytes() == np.asarray(state["params"]["w"]).tobytes()
    assert restore_local(local, _targets(state), newest_persistent=20) is None  # a newer persistent step wins
    data = local.directory / "10" / local_module.DATA
    data.write_bytes(data.read_bytes()[:-1] + b"\x01")
    with caplog.at_level(logging.WARNING):
        assert restore_local(local, _targets(state), newest_persistent=None)[2] == 5
    assert "local checkpoint" in caplog.text and "is damaged (checksum mismatch)" in caplog.text
    # The run directory was deleted and started again: its old local steps are not its history.
    assert LocalCheckpoints(tmp_path, tmp_path / "run", keep=2, history=lambda: 2.0).steps() == []


def test_the_newest_step_every_process_can_have_wins():
    replicas, own = [("a",), ("a",)], [("a",), ("b",)]
    held = np.array([[-1, 20, 15], [-1, -1, -1]])
    assert _choose(held, replicas) == (20, {0: 0, 1: 0})  # process 1 gets it from its replica
    assert _choose(held, own) is None  # nobody else holds process 1's shards
    assert _choose(np.array([[-1, 20, 15], [-1, 15, -1]]), own) == (15, {0: 0, 1: 1})
    assert _choose(np.array([[25, 20, 15], [25, 20, 15]]), own) is None  # the persistent step is newer


def test_a_full_local_disk_is_one_warning_and_saving_stops(tmp_path, monkeypatch, caplog):
    def disk_full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local_module.Path, "write_text", disk_full)  # the manifest, after the shards
    local = LocalCheckpoints(tmp_path, tmp_path / "run", keep=1, history=lambda: 1.0)
    with caplog.at_level(logging.WARNING):
        local.save(5, _state(), {})
        local.save(10, _state(), {})
        local.wait()
    warnings = [r.getMessage() for r in caplog.records if "local checkpoint not written" in r.getMessage()]
    assert len(warnings) == 1 and "step 5" in warnings[0] and "No space left on device" in warnings[0]
    assert "persistent checkpoints carry on" in warnings[0]
    assert not local.enabled and list(local.directory.iterdir()) == []  # no half-written step left behind


def test_an_unwritable_local_dir_warns_and_the_run_saves_persistently(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="functrain"):
        result = fit("configs/mlp_digits.yaml", **TINY,
                     **{"run.dir": str(tmp_path / "run"), "checkpoint.local_dir": str(tmp_path / "file" / "local"),
                        "checkpoint.local_every_steps": 5})
    assert result.step == 20 and result.stop_reason == "finished"
    assert caplog.text.count("local checkpoint not written") == 1 and "cannot be created" in caplog.text
    assert (tmp_path / "run" / "checkpoints" / "20").is_dir()


@pytest.mark.parametrize("overrides, named", [
    (["checkpoint.local_every_steps=5"], "checkpoint.local_every_steps needs checkpoint.local_dir"),
    (["checkpoint.local_dir=/dev/shm/x"], "checkpoint.local_dir needs checkpoint.local_every_steps"),
    (["checkpoint.local_dir=RUN/local", "checkpoint.local_every_steps=5"], "is inside run.dir"),
    (["checkpoint.local_dir=/dev/shm/x", "checkpoint.local_every_steps=3"], "not a multiple of train.steps_per_call"),
])
def test_local_checkpoint_settings_that_cannot_work_are_refused(tmp_path, overrides, named):
    overrides = [item.replace("RUN", str(tmp_path)) for item in overrides]
    with pytest.raises(ConfigError, match=named):
        load_config("configs/mlp_digits.yaml", [f"run.dir={tmp_path}", *overrides])


def test_the_command_line_refuses_a_local_dir_inside_the_run_dir_in_one_line(tmp_path, capsys):
    status = cli.main(["train", "configs/mlp_digits.yaml", f"run.dir={tmp_path}", "checkpoint.local_every_steps=5",
                       f"checkpoint.local_dir={tmp_path}/local"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "is inside run.dir" in err
    assert list(tmp_path.iterdir()) == []
