"""Verified checkpoints: checksums, missing items and markers, relative paths, one line per error.

A step is whole only when every item it was saved with is there, committed, and its data files match the
checksums recorded when they were written; anything else falls back to the newest whole step, and a run
that falls back retrains to the same parameters.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO_ROOT, cli_env
from functrain.checkpoint import Checkpointer, list_checkpoints, load_params, load_params_and_meta, params_digest
from functrain.checkpoint import checksum, layout, meta
from functrain.commands.inspect import inspect_report
from tests.checkpoint.test_checkpoint import assert_trees_equal, checkpoint_warnings, make_state, save_steps, targets_for, to_items
from tests.commands.test_cli import TINY, snapshot

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

CONFIG = str(REPO_ROOT / "configs" / "mlp_digits.yaml")


def zero_largest_data_file(item_dir: Path) -> Path:
    """Overwrite the biggest array data file of an item with zeros, keeping its size."""
    data = max((p for p in item_dir.glob("ocdbt.process_*/d/*")), key=lambda p: p.stat().st_size)
    data.write_bytes(bytes(data.stat().st_size))
    return data


# ------------------------------------------------------------------------------------ unit level
def test_zeroed_data_file_is_damage_found_by_checksums(tmp_path, caplog):
    save_steps(tmp_path, [1, 2], keep=5)
    step_dir = layout.checkpoints_dir(tmp_path) / "2"
    assert json.loads((step_dir / "meta" / "metadata").read_text())["checksums"] == checksum.meta_record(1)
    zeroed = zero_largest_data_file(step_dir / "params")
    # Metadata alone cannot see it; reading the arrays would return zeros without the checksums.
    assert all(info.whole for info in list_checkpoints(tmp_path, verify=False))
    infos = {info.step: info for info in list_checkpoints(tmp_path, verify=True)}
    assert infos[1].whole and not infos[2].whole
    assert infos[2].problem == f"checksum mismatch in params/{zeroed.relative_to(step_dir / 'params')} " \
                               f"(written by process 0)"
    with caplog.at_level(logging.WARNING):
        items, _, step = Checkpointer(tmp_path).restore(targets_for(make_state()))
    assert step == 1
    assert_trees_equal(items, to_items(make_state(1)))
    assert "using step 1, the newest whole one" in checkpoint_warnings(caplog)[0]
    assert_trees_equal(load_params(tmp_path), make_state(1).params)


def _drop_state(step_dir: Path):
    shutil.rmtree(step_dir / "state")


def _drop_params(step_dir: Path):
    shutil.rmtree(step_dir / "params")


def _drop_step_marker(step_dir: Path):
    (step_dir / "commit_success.txt").unlink()


def _drop_item_marker(step_dir: Path):
    (step_dir / "state" / "commit_success.txt").unlink()


def _drop_checksum_record(step_dir: Path):
    (step_dir / "params" / "checksums.process_0.json").unlink()


@pytest.mark.parametrize("damage, problem", [
    (_drop_state, "no state item"), (_drop_params, "no params item"),
    (_drop_step_marker, "no commit marker (commit_success.txt)"), (_drop_item_marker, "no commit marker in state/"),
    (_drop_checksum_record, "missing or unreadable params/checksums.process_0.json")])
def test_a_step_missing_an_item_a_marker_or_its_checksums_is_damaged(tmp_path, damage, problem):
    save_steps(tmp_path, [1, 2], keep=5)
    damage(layout.checkpoints_dir(tmp_path) / "2")
    infos = {info.step: info for info in list_checkpoints(tmp_path, verify=damage is _drop_checksum_record)}
    assert infos[1].whole and not infos[2].whole and infos[2].problem == problem
    assert Checkpointer(tmp_path).restore(targets_for(make_state()))[2] == 1  # never a fresh start
    assert load_params_and_meta(tmp_path)[1]["step"] == 1


def test_a_converted_model_has_no_state_item_by_design(tmp_path):
    ckpt = Checkpointer(tmp_path)  # as torch_bridge.hf.run_store saves it: params and meta only
    ckpt.save(0, {"params": make_state(5).params}, {"converted_from": "/hf"})
    ckpt.close()
    assert [info.whole for info in list_checkpoints(tmp_path, verify=True)] == [True]
    items, saved_meta, _ = Checkpointer(tmp_path).restore(targets_for(make_state()))
    assert set(items) == {"params"} and saved_meta["items"] == ["params"]
    # Steps written before items were recorded: params and state, except converted ones.
    assert meta.saved_items({"converted_from": "/hf"}) == ["params"]
    assert meta.saved_items({}) == ["params", "state"]


def test_relative_paths_work_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_steps(Path("runs/x"), [1, 2], keep=5)
    assert (tmp_path / "runs/x/checkpoints/2").is_dir()
    assert [info.whole for info in list_checkpoints("runs/x", verify=True)] == [True, True]
    assert_trees_equal(load_params("runs/x"), make_state(2).params)
    params, saved_meta = load_params_and_meta("runs/x/checkpoints/1")
    assert saved_meta["step"] == 1
    assert_trees_equal(params, make_state(1).params)
    report = inspect_report("runs/x", verify=True, digest=True)
    assert "2 whole, 0 damaged" in report and params_digest(make_state(2).params) in report
    assert Checkpointer("runs/x").restore(targets_for(make_state()))[2] == 2


# ------------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 40-step run trained by the CLI from another working directory with run.dir=runs/x."""
    from functrain.commands.cli import main

    cwd = tmp_path_factory.mktemp("relative")
    with pytest.MonkeyPatch.context() as patch:  # the CLI's entry point in this process, from that directory
        patch.chdir(cwd)
        assert main(["train", CONFIG, "run.dir=runs/x", *TINY]) == 0
    assert layout.committed_steps(cwd / "runs/x/checkpoints") == [20, 40]
    return cwd


def _copy(trained: Path, name: str) -> Path:
    shutil.copytree(trained / "runs/x", trained / "runs" / name)
    return trained / "runs" / name


@pytest.mark.parametrize("damage", ["zeroed", "no_params"])
def test_a_finished_run_whose_last_checkpoint_is_damaged_retrains_to_the_same_digest(trained, damage, monkeypatch,
                                                                                     caplog):
    from functrain.run.fit import fit
    run_dir = _copy(trained, damage)
    if damage == "zeroed":
        zero_largest_data_file(run_dir / "checkpoints/40/params")
    else:
        shutil.rmtree(run_dir / "checkpoints/40/params")
    monkeypatch.chdir(trained)
    overrides = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in TINY)}
    with caplog.at_level(logging.INFO):
        result = fit(CONFIG, **{**overrides, "run.dir": f"runs/{damage}", "log.tensorboard": False})
    assert result.step == 40 and result.stop_reason == "finished"
    said = "\n".join(record.getMessage() for record in caplog.records)
    reason = "checksum mismatch in params/" if damage == "zeroed" else "no params item"
    assert f"checkpoint step 40 in {run_dir / 'checkpoints'} is damaged ({reason}" in said
    assert "using step 20, the newest whole one" in said and "steps 20 -> 40" in said
    assert params_digest(load_params(run_dir)) == params_digest(load_params(trained / "runs/x"))
    assert [info.step for info in list_checkpoints(run_dir) if info.whole] == [20, 40]


def test_the_cli_reads_and_converts_relative_paths_and_errors_are_one_line(trained, tmp_path):
    from tests.torch_bridge.hf.test_hf_convert import build_hf_model, hf_tensors
    build_hf_model("gpt2", {}).save_pretrained(trained / "hf")
    damaged = _copy(trained, "all_damaged")
    for step in (20, 40):
        zero_largest_data_file(damaged / f"checkpoints/{step}/params")
    commands = [["inspect", "runs/x", "--verify", "--digest"], ["inspect", "runs/x/checkpoints/20"],
                ["convert", "hf-to-functrain", "hf", "runs/converted"],
                ["convert", "functrain-to-hf", "runs/converted", "exported"],
                ["convert", "functrain-to-hf", "runs/all_damaged", "not_written"]]
    script = f"""
        import json, sys
        from functrain.commands.cli import main
        codes = []
        for command in {commands!r}:
            print("@@", flush=True)
            print("@@", file=sys.stderr, flush=True)
            codes.append(main(command))
        print("@@", flush=True)
        print(json.dumps(codes))
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          cwd=trained, env=cli_env(), timeout=300)
    *outputs, codes = proc.stdout.split("@@\n")[1:]
    errors = proc.stderr.split("@@\n")[1:]
    assert json.loads(codes) == [0, 0, 0, 0, 2], proc.stderr
    assert "2 whole, 0 damaged" in outputs[0] and params_digest(load_params(trained / "runs/x")) in outputs[0]
    assert "(2 whole, 0 damaged" in outputs[1] and errors[:4] == ["", "", "", ""]
    exported, source = hf_tensors(trained / "exported"), hf_tensors(trained / "hf")
    assert exported.keys() <= source.keys() and all((exported[k] == source[k]).all() for k in exported)
    [line] = errors[4].splitlines()
    assert line.startswith(f"functrain: error: all 2 checkpoints in {damaged / 'checkpoints'} are damaged "
                           f"(newest step 40: checksum mismatch in params/") and "move them away" in line
    assert not (trained / "not_written").exists()


_LIMITED_CLI = """
import resource, runpy, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (8000, 8000))
sys.argv = ["functrain", *sys.argv[1:]]
runpy.run_module("functrain", run_name="__main__")
"""


def test_a_full_disk_during_an_async_save_is_one_line_and_keeps_the_checkpoints(trained):
    # The compilation cache's writes (to a cache of its own: every entry is new) hit the file-size limit too:
    # they must not add a line of their own.
    run_dir = _copy(trained, "full_disk")
    before = snapshot(run_dir / "checkpoints")
    proc = subprocess.run([sys.executable, "-c", _LIMITED_CLI, "train", CONFIG, f"run.dir={run_dir}", *TINY,
                           "train.max_steps=60", f"run.compile_cache={run_dir.parent / 'full_disk_cache'}"],
                          capture_output=True, text=True, env=cli_env(), timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    # Before it: the run's own start-up lines only; no tracebacks from Orbax's or tensorstore's threads.
    assert lines[-1].startswith("functrain: error: could not save checkpoint step 60") and "File too large" in lines[-1]
    assert not [line for line in lines[:-1] if "rror" in line or "Traceback" in line or "xception" in line]
    assert snapshot(run_dir / "checkpoints") == before


READ_ONLY = ("run_dir", "checkpoints")
# The runs against a read-only run directory and a read-only checkpoints directory, one interpreter for both: the
# first as `python -m functrain train` runs it (its stderr is all the process printed before), the second through
# the CLI's entry point. Each command's stderr ends at a line "@@" of its own.
_READ_ONLY_CLI = """
import runpy, sys
from functrain.commands.cli import main
first, second = sys.argv[1:]
sys.argv = ["functrain", "train", CONFIG, f"run.dir={first}", *TINY, "train.max_steps=60"]
try:
    runpy.run_module("functrain", run_name="__main__")
except SystemExit as exit:
    codes = [exit.code]
print("@@", file=sys.stderr, flush=True)
codes.append(main(["train", CONFIG, f"run.dir={second}", *TINY, "train.max_steps=60"]))
print("@@", file=sys.stderr, flush=True)
print(codes)
"""


@pytest.fixture(scope="module")
def read_only_runs(trained) -> dict:
    """For each kind of read-only directory: its run directory, its snapshot before, the exit status and stderr."""
    runs = {kind: _copy(trained, f"read_only_{kind}") for kind in READ_ONLY}
    targets = [runs["run_dir"], runs["checkpoints"] / "checkpoints"]
    before = {kind: snapshot(run_dir) for kind, run_dir in runs.items()}
    command = [sys.executable, "-c", f"CONFIG = {CONFIG!r}\nTINY = {TINY!r}\n{_READ_ONLY_CLI}",
               *(str(runs[kind]) for kind in READ_ONLY)]
    if os.geteuid() == 0:  # root writes through permissions: read-only bind mounts in a private namespace
        mounts = " && ".join(f'mount --bind -o ro "{target}" "{target}"' for target in targets)
        command = ["unshare", "--mount", "sh", "-c", f'{mounts} && exec "$@"', "sh", *command]
    else:
        subprocess.run(["chmod", "-R", "a-w", *map(str, targets)], check=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT, env=cli_env(), timeout=300)
    finally:
        subprocess.run(["chmod", "-R", "u+w", *map(str, targets)], check=True)
    *errors, at_exit = proc.stderr.split("@@\n")
    assert len(errors) == 2 and at_exit == "", proc.stderr
    codes = json.loads(proc.stdout.splitlines()[-1])
    return {kind: (runs[kind], target, before[kind], code, error)
            for kind, target, code, error in zip(READ_ONLY, targets, codes, errors)}


@pytest.mark.parametrize("read_only", READ_ONLY)
def test_a_read_only_run_directory_is_one_line_and_left_untouched(read_only_runs, read_only):
    run_dir, target, before, returncode, stderr = read_only_runs[read_only]
    assert returncode == 2, stderr
    [line] = stderr.splitlines()
    assert line.startswith("functrain: error: ") and str(target) in line, line
    assert ("read-only" in line or "Read-only" in line) and "choose another run.dir" in line
    assert snapshot(run_dir) == before
