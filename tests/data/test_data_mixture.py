"""Mixtures: proportions for any process count, data schedules that repeat nothing, bitwise kill + resume,
and bad input (weights, paths, record layouts) as one line with exit 2."""

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
from functrain.data import BatchLoader, Mixture, MixtureSampler
from functrain.errors import DataError
from functrain.commands.inspect import inspect_report
from tests.run.test_resume_bitwise import DRIVER

MLP = {"name": "mlp", "hidden": [16], "num_classes": 10}
RUN = {"seed": 0, "model": MLP, "optimizer": {"name": "adamw", "learning_rate": 0.01},
       "data": {"global_batch_size": 8, "prefetch": 0},
       "train": {"steps_per_call": 2}, "log": {"every_steps": 2, "progress": False, "tensorboard": False,
                                                 "trackers": ["jsonl"]}}


def _records(source: int, count: int, width: int = 4) -> dict:
    """Records whose features say which source and record they are."""
    index = np.arange(count)
    x = np.stack([np.full(count, source), index, *[np.sin(index * (j + 1)) for j in range(width - 2)]], axis=1)
    return {"x": x.astype(np.float32), "y": ((index + source) % 10).astype(np.int32)}


def _counts(rows: np.ndarray, sources: int) -> np.ndarray:
    return np.bincount(rows.astype(np.int64), minlength=sources)


def test_proportions_within_sampling_error_and_the_same_for_1_2_4_processes():
    weights = (5.0, 3.0, 2.0)
    mixture = Mixture([(_records(k, 50 + 30 * k), w) for k, w in enumerate(weights)], block_size=100)
    sampler = MixtureSampler(mixture, global_batch_size=32, seed=7)
    steps = 40
    per_process = {}
    for processes in (1, 2, 4):
        loaders = [BatchLoader(mixture, sampler, p, processes, prefetch=0) for p in range(processes)]
        rows = []
        for step in range(steps):
            rows.append(np.concatenate([loader.host_batch(step * 32)[0]["x"] for loader in loaders]))
        per_process[processes] = np.concatenate(rows)
    np.testing.assert_array_equal(per_process[1], per_process[2])
    np.testing.assert_array_equal(per_process[1], per_process[4])
    counts = _counts(per_process[1][:, 0], 3)
    expected = np.asarray(weights) / sum(weights) * steps * 32
    # Exact in every whole block of 100; the partial block's hypergeometric error is a few samples.
    assert np.all(np.abs(counts - expected) <= 3 * np.sqrt(expected)), (counts, expected)
    np.testing.assert_array_equal(_counts(per_process[1][:1200, 0], 3), [600, 360, 240])  # 12 whole blocks
    # No source repeats a record before its pass ends (source 0: 50 records, 640 draws -> 12 passes).
    first_pass = per_process[1][per_process[1][:, 0] == 1][:80, 1]
    assert len(set(first_pass)) == 80


def test_resume_at_a_far_position_is_arithmetic():
    mixture = Mixture([(_records(0, 30), 1.0), (_records(1, 70), 2.0)], block_size=64)
    sampler = MixtureSampler(mixture, 16, seed=1)
    position = 10**12 + 48
    records, _, next_position = sampler.batch_at(position)
    sources, _ = sampler.sources_and_records(np.arange(position, position + 16))
    assert next_position == position + 16 and set(sources) <= {0, 1}
    assert sum(sampler.consumed(position)) == position
    np.testing.assert_array_equal(records, MixtureSampler(mixture, 16, seed=1).batch_at(position)[0])


class RecordedMixture(Mixture):
    """Records the (source, record) pairs of every gather, one list per call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = []

    def gather(self, indices):
        which, local = self.locate(indices)
        self.calls.append(list(zip(which.tolist(), local.tolist())))
        return super().gather(indices)


def _fit_mixture(run_dir: Path, weights: tuple, max_steps: int, sources: list) -> list:
    """Train on a mixture of ``sources`` with ``weights`` up to ``max_steps``; the (source, record) pairs of the
    batches trained on (with prefetch 0 the training batches are the loader's last gathers)."""
    mixture = RecordedMixture(list(zip(sources, weights)), block_size=32)
    result = functrain.fit(RUN, train_data=mixture, **{"run.dir": str(run_dir), "train.max_steps": max_steps,
                                                      "checkpoint.every_steps": 0})
    return [pair for call in mixture.calls[len(mixture.calls) - result.steps_run:] for pair in call]


def test_weight_change_at_resume_repeats_no_sample(tmp_path, compilation_cache):
    sources = [_records(0, 60), _records(1, 400)]
    before = _fit_mixture(tmp_path, (1.0, 1.0), 6, sources)
    after = _fit_mixture(tmp_path, (1.0, 5.0), 14, sources)
    assert len(before) == 48 and len(after) == 64
    for source in (0, 1):  # no source wraps into its next pass here (at most 60 and 400 draws)
        seen_before = {record for k, record in before if k == source}
        seen_after = {record for k, record in after if k == source}
        assert seen_before and seen_after and not seen_before & seen_after
    share_after = sum(k == 1 for k, _ in after) / len(after)
    assert 0.7 < share_after < 0.95  # the new weights (5/6) rule after the change
    meta = list_checkpoints(tmp_path)[-1].meta["mixture"]
    assert [s["start"] for s in meta["segments"]] == [0, 48] and meta["segments"][1]["weights"] == [1.0, 5.0]
    assert meta["segments"][1]["offsets"] == [sum(k == 0 for k, _ in before), sum(k == 1 for k, _ in before)]


def _write_sources(tmp_path: Path, layouts: list) -> list:
    paths = []
    for k, records in enumerate(layouts):
        path = tmp_path / f"source{k}.npz"
        np.savez(path, **records)
        paths.append(str(path))
    return paths


def _config(tmp_path: Path, sources: list) -> Path:
    config = {**RUN, "data": {**RUN["data"], "sources": sources, "eval_fraction": 0.0}}
    path = tmp_path / "mixture.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _attempt(config: Path, run_dir: Path, kill: str, cache: dict) -> subprocess.CompletedProcess:
    args = ["train", str(config), f"run.dir={run_dir}", "train.max_steps=16", "checkpoint.every_steps=4"]
    return subprocess.run([sys.executable, "-c", DRIVER, *args], cwd=REPO_ROOT, env=cli_env(FT_KILL=kill, **cache),
                          capture_output=True, text=True, timeout=300)


def _digest(run_dir: Path) -> str:
    return next(line for line in inspect_report(run_dir, digest=True).splitlines() if line.startswith("sha256"))


def test_mixture_run_killed_and_resumed_is_bitwise_equal(tmp_path, compilation_cache):
    paths = _write_sources(tmp_path, [_records(0, 40), _records(1, 90), _records(2, 25)])
    config = _config(tmp_path, [{"path": p, "weight": w} for p, w in zip(paths, (2.0, 5.0, 1.0))])
    reference = tmp_path / "reference"
    assert cli.main(["train", str(config), f"run.dir={reference}", "train.max_steps=16",
                     "checkpoint.every_steps=4"]) == 0
    interrupted = tmp_path / "interrupted"
    assert _attempt(config, interrupted, "save:2", compilation_cache).returncode == -9  # killed, save 8 in flight
    assert 0 < [info.step for info in list_checkpoints(interrupted) if info.whole][-1] < 16
    assert cli.main(["train", str(config), f"run.dir={interrupted}", "train.max_steps=16",
                     "checkpoint.every_steps=4"]) == 0  # the resume, in this process (one jax start-up less)
    assert _digest(interrupted) == _digest(reference)


def _bad_input(tmp_path: Path, capsys, sources: list) -> str:
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted((str(p), p.read_bytes() if p.is_file() else b"") for p in run_dir.rglob("*"))
    capsys.readouterr()
    assert cli.main(["train", str(_config(tmp_path, sources)), f"run.dir={run_dir}", "train.max_steps=2"]) == 2
    assert sorted((str(p), p.read_bytes() if p.is_file() else b"") for p in run_dir.rglob("*")) == before
    message = capsys.readouterr().err.strip()
    assert "\n" not in message and message.startswith("functrain: error: ")
    return message


def test_bad_mixtures_are_one_line_exit_2_and_touch_nothing(tmp_path, capsys):
    paths = _write_sources(tmp_path, [_records(0, 20), _records(1, 20), _records(2, 20, width=6),
                                      {"tokens": np.zeros((20, 9), np.int32)}])
    message = _bad_input(tmp_path, capsys, [{"path": paths[0], "weight": 1}, {"path": paths[1], "weight": 0}])
    assert "data.sources.1.weight" in message and "must be > 0" in message
    message = _bad_input(tmp_path, capsys, [{"path": paths[0], "weight": 1}, {"path": "nope.npz", "weight": 1}])
    assert "'nope.npz' does not exist" in message
    message = _bad_input(tmp_path, capsys, [{"path": paths[0], "weight": 1}, {"path": paths[2], "weight": 1}])
    assert "data.sources[1]" in message and "float32[6]" in message and "same fields" in message
    message = _bad_input(tmp_path, capsys, [{"path": paths[0], "weight": 1}, {"path": paths[3], "weight": 1}])
    assert "tokens" in message and "same fields" in message


def test_mixture_python_errors():
    with pytest.raises(DataError, match="weight -1"):
        Mixture([(_records(0, 5), 1.0), (_records(1, 5), -1)])
    with pytest.raises(DataError, match="no sample in a block of 16"):
        Mixture([(_records(0, 5), 1.0), (_records(1, 5), 1e-3)], block_size=16)
    sampler = MixtureSampler(Mixture([(_records(0, 5), 1.0), (_records(1, 5), 1.0)]), 4, 0)
    meta = sampler.extra_meta(8)
    other = MixtureSampler(Mixture([(_records(0, 5), 1.0), (_records(1, 6), 1.0)]), 4, 0)
    with pytest.raises(DataError, match="keep those sources first and in order"):
        other.restore(meta, 8)


def test_a_source_added_at_resume_starts_fresh_and_the_others_continue():
    two = [(_records(0, 50), 1.0), (_records(1, 80), 1.0)]
    before = MixtureSampler(Mixture(two, block_size=16), 8, seed=3)
    after = MixtureSampler(Mixture(two + [(_records(2, 30), 2.0)], block_size=16), 8, seed=3)
    after.restore(before.extra_meta(40), 40)
    early = np.arange(40)
    for got, want in zip(after.sources_and_records(early), before.sources_and_records(early)):
        np.testing.assert_array_equal(got, want)  # the recorded past is unchanged
    sources, items = after.locate(np.arange(40, 40 + 16 * 3))
    for k, start in enumerate(before.consumed(40) + (0,)):
        np.testing.assert_array_equal(np.sort(items[sources == k]), start + np.arange((sources == k).sum()))
    assert (sources == 2).sum() == 24  # half of each block of 16 from position 40 on


def test_a_source_weight_is_overridden_by_its_index(tmp_path):
    from functrain.config.load import load_config
    from functrain.errors import ConfigError
    config = _config(tmp_path, [{"path": "a.npz", "weight": 1.0}, {"path": "b.npz", "weight": 2.0}])
    assert load_config(config, ["data.sources.1.weight=4"]).data.sources[1].weight == 4.0
    with pytest.raises(ConfigError, match="index it with a number from 0 to 1"):
        load_config(config, ["data.sources.2.weight=4"])
