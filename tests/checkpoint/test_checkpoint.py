"""Checkpoint package: atomic commit, fallback past damage, retention, errors, digest, inspect."""

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from functrain.checkpoint import (Checkpointer, list_checkpoints, load_params, params_digest)
from functrain.checkpoint import layout, reader, retention
from functrain.errors import CheckpointError
from functrain.commands.inspect import inspect_report

# When a read fails, orbax/tensorstore leave an "Event loop is closed" callback behind: noise, not ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@flax.struct.dataclass
class StandInState:
    """Mimics functrain.core.state.TrainState for checkpoint tests."""

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    model_state: Any


def make_state(seed: int = 0, width: int = 3) -> StandInState:
    rng = jax.random.PRNGKey(seed)
    params = {"dense": {"kernel": jax.random.normal(rng, (4, width)), "bias": jnp.arange(width, dtype=jnp.float32)},
              "out": {"kernel": jnp.full((width, 2), float(seed))}}
    opt_state = optax.adamw(1e-3).init(params)
    opt_state = jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x, opt_state)
    return StandInState(step=jnp.int32(seed), params=params, opt_state=opt_state, rng=rng,
                        model_state={"batch_stats": {"mean": jnp.ones((width,))}})


def to_items(state: StandInState) -> dict:
    return {"params": state.params,
            "state": {"step": state.step, "opt_state": state.opt_state, "rng": state.rng,
                      "model_state": state.model_state}}


def targets_for(state: StandInState) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), to_items(state))


def save_steps(run_dir: Path, steps, losses=None, **kwargs) -> Checkpointer:
    ckpt = Checkpointer(run_dir, **kwargs)
    for i, step in enumerate(steps):
        metrics = {"eval": {"loss": losses[i]}} if losses else {}
        ckpt.save(step, to_items(make_state(step)), {"epoch": 0, "samples_consumed": step * 8, "metrics": metrics})
    ckpt.close()
    return ckpt


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def checkpoint_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "functrain.checkpoint" and r.levelno == logging.WARNING]


def test_roundtrip_restores_values_structure_and_meta(tmp_path):
    save_steps(tmp_path, [1, 2], keep=5)
    ckpt = Checkpointer(tmp_path)
    items, meta, step = ckpt.restore(targets_for(make_state()))
    ckpt.close()
    assert step == 2 and meta["step"] == 2 and meta["samples_consumed"] == 16 and meta["format_version"] == 1
    assert meta["versions"]["jax"] == jax.__version__ and meta["time"] > 0
    assert_trees_equal(items, to_items(make_state(2)))
    assert type(items["state"]["opt_state"][0]) is type(make_state().opt_state[0])  # namedtuple restored
    assert Checkpointer(tmp_path).restore(targets_for(make_state()), step="never") is None


def test_uncommitted_tmp_dir_is_never_listed_or_restored(tmp_path):
    save_steps(tmp_path, [1, 2], keep=5)
    ckpt_dir = layout.checkpoints_dir(tmp_path)
    shutil.copytree(ckpt_dir / "2", ckpt_dir / "3.orbax-checkpoint-tmp")  # a save that never committed
    assert layout.committed_steps(ckpt_dir) == [1, 2]
    infos = list_checkpoints(tmp_path, verify=False)
    assert [(i.step, i.whole) for i in infos] == [(1, True), (2, True), (3, False)]
    ckpt = Checkpointer(tmp_path)
    assert ckpt.restore(targets_for(make_state()))[2] == 2
    ckpt.save(3, to_items(make_state(3)), {})  # the writer clears the interrupted save before its first save
    ckpt.close()
    assert not (ckpt_dir / "3.orbax-checkpoint-tmp").exists()
    assert ckpt.steps() == [1, 2, 3]


def test_process_killed_during_async_save_leaves_only_committed_steps(tmp_path, python_runner):
    python_runner(f"""
        import os, numpy as np, jax.numpy as jnp
        from functrain.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save(1, {{"params": {{"w": jnp.ones((4,))}}}}, {{}}); ckpt.wait()
        ckpt.save(2, {{"params": {{"w": jnp.ones((64, 1024, 1024), jnp.uint8)}}}}, {{}})
        os._exit(0)  # die while the background write is in flight
    """)
    ckpt_dir = layout.checkpoints_dir(tmp_path)
    assert layout.committed_steps(ckpt_dir) == [1]
    assert [p.name.split(".")[0] for p in layout.uncommitted_dirs(ckpt_dir)] == ["2"]
    np.testing.assert_array_equal(load_params(tmp_path)["w"], np.ones((4,)))


def _truncate_params_data(step_dir: Path):
    for f in (step_dir / "params" / "d").iterdir():
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def _delete_state_data(step_dir: Path):
    for f in (step_dir / "state" / "d").iterdir():
        f.unlink()


def _corrupt_meta(step_dir: Path):
    (step_dir / "meta" / "metadata").write_text('{"format_version": 1, "step": ')


def _delete_meta(step_dir: Path):
    (step_dir / "meta" / "metadata").unlink()


@pytest.mark.parametrize("damage", [_truncate_params_data, _delete_state_data, _corrupt_meta, _delete_meta])
def test_damaged_latest_falls_back_with_one_warning(tmp_path, caplog, damage):
    save_steps(tmp_path, [1, 2, 3], keep=5)
    damage(layout.checkpoints_dir(tmp_path) / "3")
    ckpt = Checkpointer(tmp_path)
    with caplog.at_level(logging.WARNING):
        items, meta, step = ckpt.restore(targets_for(make_state()))
    assert step == 2 and meta["step"] == 2
    assert_trees_equal(items, to_items(make_state(2)))
    warnings = checkpoint_warnings(caplog)
    assert len(warnings) == 1 and "step 3" in warnings[0] and "damaged" in warnings[0]
    # the damaged step stays on disk for inspection; inspect reports it
    ckpt.close()
    assert {i.step: i.whole for i in list_checkpoints(tmp_path)} == {1: True, 2: True, 3: False}


def test_all_damaged_raises_once_per_step_without_looping(tmp_path, caplog, monkeypatch):
    save_steps(tmp_path, [1, 2], keep=5)
    for step in (1, 2):
        _corrupt_meta(layout.checkpoints_dir(tmp_path) / str(step))
    tried = []
    real_restore_step = reader.restore_step
    monkeypatch.setattr(reader, "restore_step", lambda path, targets: tried.append(path.name) or
                        real_restore_step(path, targets))
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError, match="all 2 checkpoints"):
        Checkpointer(tmp_path).restore(targets_for(make_state()))
    assert tried == ["2", "1"]
    assert checkpoint_warnings(caplog) == []  # the one error line says it all


def test_explicit_step_missing_or_damaged_is_an_error(tmp_path):
    save_steps(tmp_path, [1, 2], keep=5)
    ckpt = Checkpointer(tmp_path)
    with pytest.raises(CheckpointError, match="no checkpoint for step 7.*steps there: 1, 2"):
        ckpt.restore(targets_for(make_state()), step=7)
    _truncate_params_data(layout.checkpoints_dir(tmp_path) / "1")
    with pytest.raises(CheckpointError, match="step 1 .*damaged"):
        ckpt.restore(targets_for(make_state()), step=1)
    assert ckpt.restore(targets_for(make_state()), step=2)[2] == 2
    ckpt.close()


def test_resume_without_state_item_returns_params_only(tmp_path):
    ckpt = Checkpointer(tmp_path)  # like a converted HF model: params + meta only
    ckpt.save(0, {"params": make_state(5).params}, {"model": {"name": "mlp"}})
    ckpt.close()
    items, meta, step = Checkpointer(tmp_path).restore(targets_for(make_state()))
    assert set(items) == {"params"} and step == 0 and meta["model"] == {"name": "mlp"}
    assert_trees_equal(items["params"], make_state(5).params)


# ------------------------------------------------------------------------------------ retention
def test_retention_policy_keeps_latest_best_and_protected():
    metrics = {10: 0.5, 20: 0.1, 30: 0.9, 40: 0.7, 50: None}
    delete = retention.steps_to_delete([10, 20, 30, 40, 50], keep=2, keep_best=1, metrics=metrics,
                                       mode="min", protected={10})
    assert delete == [30]  # kept: latest 40, 50; best 20 (min); protected 10
    delete = retention.steps_to_delete([10, 20, 30, 40, 50], keep=1, keep_best=2, metrics=metrics,
                                       mode="max", protected=set())
    assert delete == [10, 20]  # kept: newest 50 (no metric), best 30 and 40 (max)
    assert retention.steps_to_delete([1, 2, 3], keep=None, keep_best=0, metrics={}, mode="min", protected=set()) == []
    # the newest is kept even when keep_best would rank it last
    assert 3 not in retention.steps_to_delete([1, 2, 3], keep=1, keep_best=1, metrics={1: 0.1, 2: 0.2, 3: 9.0},
                                              mode="min", protected=set())


def test_rotation_keeps_latest_plus_best_and_deletes_only_after_commit(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, keep_best=1, best_metric="eval/loss", best_mode="min")
    deleted_while_committed = []
    real_delete = ckpt._manager.delete

    def checked_delete(step):
        deleted_while_committed.append((step, ckpt._line_head in layout.committed_steps(ckpt.directory)))
        real_delete(step)

    ckpt._manager.delete = checked_delete
    for step, loss in zip([1, 2, 3, 4, 5], [5.0, 1.0, 4.0, 3.0, 2.0]):
        ckpt.save(step, to_items(make_state(step)), {"metrics": {"eval": {"loss": loss}}})
    ckpt.close()
    assert ckpt.steps() == [2, 4, 5]  # latest two + the best (step 2, loss 1.0)
    assert sorted(s for s, _ in deleted_while_committed) == [1, 3]
    assert all(committed for _, committed in deleted_while_committed)
    best = [i.step for i in list_checkpoints(tmp_path, verify=False) if i.is_best]
    assert best == [2]


def test_resumed_from_step_is_never_deleted(tmp_path):
    save_steps(tmp_path, [1, 2, 3], keep=5)
    ckpt = Checkpointer(tmp_path, keep=1)
    assert ckpt.restore(targets_for(make_state()), step=2)[2] == 2
    for step in (3, 4, 5):  # 3 exists from the abandoned line of history: it is moved aside, not deleted
        ckpt.save(step, to_items(make_state(step)), {})
    ckpt.close()
    assert ckpt.steps() == [2, 5]
    assert [p.name.split(".")[1].split("-")[0] for p in ckpt.directory.iterdir() if p.name.startswith("3.")] \
        == ["replaced"]


def test_final_save_of_the_resumed_step_is_a_no_op(tmp_path):
    save_steps(tmp_path, [4], keep=5)
    ckpt = Checkpointer(tmp_path)
    ckpt.restore(targets_for(make_state()))
    assert ckpt.save(4, to_items(make_state(4)), {}) is False
    ckpt.close()
    assert ckpt.steps() == [4]


# ------------------------------------------------------------------------------------ bad input
def test_incompatible_model_lists_paths_with_both_shapes_and_deletes_nothing(tmp_path):
    save_steps(tmp_path, [1, 2], keep=5)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    other = make_state(width=5)
    targets = targets_for(other)
    targets["params"]["extra"] = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    del targets["params"]["out"]
    with pytest.raises(CheckpointError) as error:
        Checkpointer(tmp_path).restore(targets)
    message = str(error.value)
    assert "\n" not in message
    assert "params/dense/kernel: checkpoint float32[4,3] vs model float32[4,5]" in message
    assert "params/extra/w: missing from checkpoint" in message
    assert "params/out/kernel: in checkpoint but not in model" in message
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_newer_format_version_asks_to_upgrade(tmp_path):
    save_steps(tmp_path, [1], keep=5)
    meta_file = layout.checkpoints_dir(tmp_path) / "1" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps(dict(meta, format_version=99)))
    with pytest.raises(CheckpointError, match="format_version 99.*upgrade functrain"):
        Checkpointer(tmp_path).restore(targets_for(make_state()))
    with pytest.raises(CheckpointError, match="upgrade functrain"):
        load_params(tmp_path, step=1)


def test_path_that_is_not_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "missing")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a functrain checkpoint"):
        load_params(tmp_path / "junk")
    with pytest.raises(CheckpointError, match="not a functrain checkpoint"):
        list_checkpoints(tmp_path / "junk")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("a file")
    with pytest.raises(CheckpointError, match="is a file"):
        Checkpointer(tmp_path / "run")


def _fail_directory_creation(monkeypatch):
    """Make every new checkpoint directory fail as on a full disk."""
    from orbax.checkpoint._src.path import async_path

    async def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(async_path, "mkdir", no_space)


def test_full_disk_with_on_error_warn_keeps_previous_and_continues(tmp_path, caplog, monkeypatch):
    ckpt = Checkpointer(tmp_path, on_error="warn", keep=1)
    ckpt.save(1, to_items(make_state(1)), {})
    ckpt.wait()
    _fail_directory_creation(monkeypatch)
    with caplog.at_level(logging.WARNING):
        ckpt.save(2, to_items(make_state(2)), {})
        ckpt.save(3, to_items(make_state(3)), {})  # training goes on; the failure of 2 surfaces here
        ckpt.wait()
    warnings = checkpoint_warnings(caplog)
    assert len(warnings) == 2 and "step 2" in warnings[0] and "No space left on device" in warnings[0]
    assert "newest: step 1" in warnings[0]
    monkeypatch.undo()
    ckpt.save(4, to_items(make_state(4)), {})
    ckpt.close()
    assert ckpt.steps() == [4]  # rotation resumed once a save committed again
    assert not layout.uncommitted_dirs(ckpt.directory)


def test_full_disk_with_on_error_stop_raises_clear_error(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, on_error="stop", keep=1)
    ckpt.save(1, to_items(make_state(1)), {})
    ckpt.wait()
    _fail_directory_creation(monkeypatch)
    with pytest.raises(CheckpointError, match=r"step 2 .*No space left on device.*intact \(newest: step 1\)"):
        ckpt.save(2, to_items(make_state(2)), {})
        ckpt.wait()
    monkeypatch.undo()
    ckpt.close()
    assert_trees_equal(load_params(tmp_path), make_state(1).params)


@pytest.mark.parametrize("on_error", ["warn", "stop"])
def test_real_write_failure_in_background_keeps_previous(tmp_path, python_runner, on_error):
    # RLIMIT_FSIZE makes the filesystem refuse big writes (EFBIG) inside tensorstore's threads.
    proc = python_runner(f"""
        import resource, signal, logging
        import numpy as np
        import jax.numpy as jnp
        from functrain.checkpoint import Checkpointer
        from functrain.errors import CheckpointError
        logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
        ckpt = Checkpointer({str(tmp_path)!r}, on_error={on_error!r}, keep=1)
        ckpt.save(1, {{"params": {{"w": jnp.ones((8,))}}}}, {{}}); ckpt.wait()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            incompressible = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
            ckpt.save(2, {{"params": {{"w": jnp.asarray(incompressible)}}}}, {{}})
            ckpt.wait()
            print("CONTINUED")
        except CheckpointError as error:
            print("STOPPED", error)
        ckpt.close()
    """)
    expected = "CONTINUED" if on_error == "warn" else "STOPPED could not save checkpoint step 2"
    assert expected in proc.stdout
    assert layout.committed_steps(layout.checkpoints_dir(tmp_path)) == [1]
    np.testing.assert_array_equal(load_params(tmp_path)["w"], np.ones((8,)))


def test_the_cli_silences_the_coroutines_a_failed_save_abandons_and_nothing_before(python_runner):
    # Collected at exit, they warn "coroutine ... was never awaited" after the error's one line.
    proc = python_runner("""
        import gc, sys
        from functrain.report.noise import silence_background_tracebacks
        async def abandoned():
            pass
        abandoned(); gc.collect()
        print("@@", file=sys.stderr, flush=True)
        silence_background_tracebacks()
        abandoned(); gc.collect()
    """)
    before, after = proc.stderr.split("@@\n")
    assert "coroutine 'abandoned' was never awaited" in before and after == ""


# ------------------------------------------------------------------------------------ reading
def test_params_digest_is_order_independent_and_value_sensitive():
    params = make_state(3).params
    reordered = {"out": params["out"], "dense": {"bias": params["dense"]["bias"], "kernel": params["dense"]["kernel"]}}
    digest = params_digest(params)
    assert digest == params_digest(reordered) == params_digest(jax.tree.map(np.asarray, params))
    assert len(digest) == 64
    changed = jax.tree.map(lambda x: x, params)
    changed["out"]["kernel"] = changed["out"]["kernel"].at[0, 0].add(1e-6)
    assert params_digest(changed) != digest
    assert params_digest(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)) != digest
    renamed = {"dense2": params["dense"], "out": params["out"]}
    assert params_digest(renamed) != digest


def test_load_params_and_inspect_report(tmp_path):
    save_steps(tmp_path, [10, 20, 30], losses=[0.9, 0.3, 0.5], keep=5, keep_best=1, best_metric="eval/loss")
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 31):
            f.write(json.dumps({"step": step, "split": "train", "loss": 1.0 / step}) + "\n")
    params = load_params(tmp_path, step=20)
    assert isinstance(params["dense"]["kernel"], np.ndarray)
    assert_trees_equal(params, make_state(20).params)
    assert params_digest(load_params(tmp_path / "checkpoints" / "30")) == params_digest(make_state(30).params)
    _corrupt_meta(layout.checkpoints_dir(tmp_path) / "30")
    report = inspect_report(tmp_path, digest=True)
    lines = report.splitlines()
    row = {int(line.split()[0]): line for line in lines if line.split() and line.split()[0].isdigit()}
    assert "damaged" in row[30] and "whole" in row[20] and "best" in row[20] and "best" not in row[10]
    assert "eval/loss=0.3" in row[20]
    assert f"sha256 step 20: {params_digest(make_state(20).params)}" in report  # newest whole step
    assert '"step": 30' in report and '"step": 21' not in report  # tail of metrics.jsonl
    assert params_digest(make_state(10).params) in inspect_report(tmp_path, step=10, digest=True)
