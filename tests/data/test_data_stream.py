"""Streaming sources: exact resume after SIGKILL, HF IterableDataset state, per-process slices, stream ends, errors."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import functrain
from tests.conftest import REPO_ROOT, cli_env
from functrain.commands import cli
from functrain.checkpoint import list_checkpoints
from functrain.data import Stream, StreamLoader, StreamOrder
from functrain.errors import DataError
from functrain.commands.inspect import inspect_report
from functrain.callbacks.outcome import StopKind
from tests.data.test_data_mixture import RUN
from tests.run.test_resume_bitwise import DRIVER

# A stream of numbered records; every open and every record read is logged to $FT_STREAM_LOG.
NUMBERED = '''
import os
import numpy as np

def numbered_records(start=0, limit=10**9):
    with open(os.environ["FT_STREAM_LOG"], "a") as log:
        log.write(f"open {start}\\n")
    for i in range(start, limit):
        with open(os.environ["FT_STREAM_LOG"], "a") as log:
            log.write(f"{i}\\n")
        yield {"x": np.array([np.sin(i), np.cos(i), i % 7 / 7, 1.0], np.float32), "y": np.int32(i % 10)}
'''
ARGS = ["train.max_steps=16", "checkpoint.every_steps=4", "data.prefetch=2"]


def _reads(log: Path) -> list[tuple[int, list[int]]]:
    """Each open of the stream: (start, records read)."""
    opens = []
    for line in log.read_text().split():
        if line == "open":
            opens.append(None)
        elif opens and opens[-1] is None:
            opens[-1] = (int(line), [])
        else:
            opens[-1][1].append(int(line))
    return opens


def _digest(run_dir: Path) -> str:
    return next(line for line in inspect_report(run_dir, digest=True).splitlines() if line.startswith("sha256"))


def test_stream_resumes_at_the_exact_record_after_sigkill(tmp_path, monkeypatch, compilation_cache):
    (tmp_path / "numbered.py").write_text(NUMBERED)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "stream.yaml"
    config.write_text(yaml.safe_dump({**RUN, "data": {**RUN["data"], "target": "numbered:numbered_records"}}))
    monkeypatch.setenv("FT_STREAM_LOG", str(tmp_path / "reference.log"))
    assert cli.main(["train", str(config), f"run.dir={tmp_path / 'reference'}", *ARGS]) == 0

    run_dir = tmp_path / "interrupted"
    env = cli_env(FT_KILL="save:2", FT_STREAM_LOG=str(tmp_path / "killed.log"), PYTHONPATH=str(tmp_path),
                  **compilation_cache)
    proc = subprocess.run([sys.executable, "-c", DRIVER, "train", str(config), f"run.dir={run_dir}", *ARGS],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL with save 8 in flight, batches prefetched
    saved = [info for info in list_checkpoints(run_dir) if info.whole][-1]
    offset = saved.meta["samples_consumed"]
    assert 0 < saved.step < 16 and offset == saved.step * 8 == saved.meta["stream"]["records_consumed"]

    monkeypatch.setenv("FT_STREAM_LOG", str(tmp_path / "resumed.log"))
    assert cli.main(["train", str(config), f"run.dir={run_dir}", *ARGS]) == 0
    opens = _reads(tmp_path / "resumed.log")
    # Peeks at the fields read the first records; training opens the stream once, at the checkpoint's offset.
    assert [start for start, _ in opens[:-1]] == [0] * (len(opens) - 1) and opens[-1][0] == offset
    assert all(len(records) <= 8 for _, records in opens[:-1])
    trained = opens[-1][1][:16 * 8 - offset]
    assert trained == list(range(offset, 16 * 8))
    assert list_checkpoints(run_dir)[-1].meta["samples_consumed"] == 16 * 8
    assert _digest(run_dir) == _digest(tmp_path / "reference")


def _hf_stream(calls: list):
    from datasets import Dataset
    data = Dataset.from_dict({"x": np.arange(200, dtype=np.float32)[:, None], "y": np.arange(200) % 10})

    def count(record):
        calls.append(record["y"])
        return record
    return data.to_iterable_dataset(num_shards=4).map(count)


def test_hf_iterable_dataset_resumes_from_its_state_and_slices_per_process():
    calls = []
    order = StreamOrder(8, seed=0)
    loader = StreamLoader(Stream(_hf_stream(calls)), order, prefetch=0)
    batches, position = [], 0
    for _ in range(9):  # across shard boundaries (50 records a shard)
        batch, position = loader.host_batch(position)
        batches.append(batch["x"][:, 0])
    np.testing.assert_array_equal(np.concatenate(batches), np.arange(72))
    meta = order.extra_meta(40)
    assert meta["stream"]["records_consumed"] == 40 and meta["stream"]["state"] is not None

    calls.clear()
    resumed = StreamOrder(8, seed=0)
    resumed.restore(meta, 40)
    halves = [StreamLoader(Stream(_hf_stream(calls)), resumed, p, 2, prefetch=0) for p in range(2)]
    rows = np.concatenate([half.host_batch(40)[0]["x"][:, 0] for half in halves])
    np.testing.assert_array_equal(rows, np.arange(40, 48))
    assert len(calls) <= 2 * 8 + 2  # each process read one batch from the saved state, not the 40 before it


def test_a_stream_that_ends_stops_after_its_last_whole_batch_and_plain_iterables_skip():
    records = [{"x": np.float32(i), "y": np.int32(i % 10)} for i in range(20)]
    loader = StreamLoader(Stream(tuple(records)), StreamOrder(4, 0), prefetch=0)
    with loader.iter_from(8, steps_per_call=2) as calls:
        got = [(call["x"].reshape(-1).tolist(), start, end) for call, start, end in calls]
    assert got == [(list(map(float, range(8, 16))), 8, 16), (list(map(float, range(16, 20))), 16, 20)]


def test_stream_errors_are_one_line(tmp_path):
    def records(start=0):
        yield from ({"x": np.zeros(4, np.float32), "y": np.int32(1)} for _ in range(100))

    with pytest.raises(DataError, match="one-shot generator.*pass the function"):
        functrain.fit(RUN, train_data=records(), **{"run.dir": str(tmp_path / "a"), "train.max_steps": 2})
    with pytest.raises(DataError, match="no known epoch length; set train.max_steps"):
        functrain.fit(RUN, train_data=records, **{"run.dir": str(tmp_path / "b"), "train.epochs": 1})
    with pytest.raises(DataError, match="must be random access"):
        functrain.fit(RUN, train_data=records, eval_data=records, **{"run.dir": str(tmp_path / "c"),
                                                                      "train.max_steps": 2})
    short = [{"x": np.zeros(4, np.float32), "y": np.int32(1)}] * 3
    with pytest.raises(DataError, match="fewer than one batch"):
        StreamLoader(Stream(tuple(short)), StreamOrder(8, 0)).host_batch(0)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_a_run_whose_stream_ends_before_max_steps_says_so(tmp_path):
    def records(start=0):
        yield from ({"x": np.full(4, i, np.float32), "y": np.int32(i % 10)} for i in range(start, 40))

    result = functrain.fit(RUN, train_data=records, **{"run.dir": str(tmp_path / "run"), "train.max_steps": 100})
    assert result.step == 5 and result.stop_kind is StopKind.DATA_ENDED
    assert "stream ended after 40 samples" in result.stop_reason and result.exit_code == 0
