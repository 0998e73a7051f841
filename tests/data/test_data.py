"""Data order, resume arithmetic, per-process slices, sources, augmentation replay, prefetch and errors."""

import threading

import numpy as np
import pytest

from functrain.data import (ArraySource, BatchLoader, IndexSampler, RecordSource, check_resume, data_meta,
                            resume_position, sample_rng, to_global)
from functrain.errors import DataError


def _arrays(num_records: int) -> dict:
    return {"x": np.arange(num_records * 3, dtype=np.float32).reshape(num_records, 3),
            "y": np.arange(num_records, dtype=np.int32)}


def _noise(record: dict, rng: np.random.Generator) -> dict:
    """An augmentation: additive noise from the per-sample RNG."""
    return {"x": record["x"] + rng.normal(size=record["x"].shape).astype(np.float32), "y": record["y"]}


def _run(loader: BatchLoader, position: int, steps: int, steps_per_call: int = 1) -> tuple[list, int]:
    """Batches (split per step) and the end position of ``steps`` steps from ``position``."""
    batches = []
    with loader.iter_from(position, steps_per_call=steps_per_call, num_steps=steps) as calls:
        for call, _, position in calls:
            batches += [{k: v[i] for k, v in call.items()} for i in range(len(call["weight"]))]
    return batches, position


def _assert_same(batches_a: list, batches_b: list) -> None:
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


# --- order ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_records", [1, 2, 7, 100, 1000])
def test_order_is_a_bijection_per_epoch_and_reshuffles(num_records):
    sampler = IndexSampler(num_records, 1, seed=3)
    epochs = [[sampler.order(e * num_records + i) for i in range(num_records)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(num_records))
    if num_records >= 7:
        assert epochs[0] != epochs[1] != epochs[2]
        other_seed = IndexSampler(num_records, 1, seed=4)
        assert [other_seed.order(i) for i in range(num_records)] != epochs[0]
        assert epochs[0] != list(range(num_records))


def test_record_indices_matches_order_and_no_shuffle_is_identity():
    sampler = IndexSampler(37, 5, seed=1)
    positions = np.array([0, 5, 36, 37, 40, 74, 1000])
    np.testing.assert_array_equal(sampler.record_indices(positions), [sampler.order(p) for p in positions])
    plain = IndexSampler(37, 5, seed=1, shuffle=False)
    np.testing.assert_array_equal(plain.record_indices(positions), positions % 37)


def test_drop_skips_epoch_tail_and_pad_wraps_with_weight_zero():
    drop = IndexSampler(10, 4, seed=0, last_batch="drop")
    assert drop.steps_per_epoch == 2
    _, _, position = drop.batch_at(4)
    assert position == 8
    indices, weights, position = drop.batch_at(8)  # 2 left in epoch 0: skipped
    np.testing.assert_array_equal(indices, drop.record_indices(np.arange(10, 14)))
    assert position == 14 and weights.tolist() == [1] * 4 and drop.epoch_of(8) == 1

    pad = IndexSampler(10, 4, seed=0, last_batch="pad")
    assert pad.steps_per_epoch == 3
    indices, weights, position = pad.batch_at(8)
    np.testing.assert_array_equal(indices, pad.record_indices(np.array([8, 9, 0, 1])))
    assert weights.tolist() == [1, 1, 0, 0] and position == 10
    # A batch larger than the dataset wraps around the same epoch repeatedly.
    big = IndexSampler(3, 7, seed=0, last_batch="pad")
    indices, weights, position = big.batch_at(0)
    assert weights.sum() == 3 and position == 3 and sorted(indices[:3]) == [0, 1, 2]


def test_batch_rows_fast_path_equals_the_general_one():
    """The per-step slice of a small dataset's permutation gives exactly the rows the vectorised lookup gives,
    for every position (mid-epoch, tails, pad wraps), row range and order kind."""
    for shuffle, last_batch in [(True, "drop"), (True, "pad"), (False, "drop"), (False, "pad")]:
        sampler = IndexSampler(23, 6, seed=3, shuffle=shuffle, last_batch=last_batch)
        for position in [0, 5, 17, 18, 20, 22, 23, 45, 1000]:
            stream, weights, next_position = sampler.batch_positions(position)
            for first, stop in [(0, 6), (0, 3), (3, 6), (2, 4)]:
                rows = sampler.batch_rows(position, first, stop)
                np.testing.assert_array_equal(rows[0], stream[first:stop])
                np.testing.assert_array_equal(rows[1], sampler.record_indices(stream[first:stop]))
                np.testing.assert_array_equal(rows[2], weights[first:stop])
                assert rows[3] == next_position


def test_batch_indices_and_steps_until_epoch_agree_with_positions():
    for last_batch in ("drop", "pad"):
        sampler = IndexSampler(23, 5, seed=2, last_batch=last_batch)
        position = 0
        for step in range(12):
            np.testing.assert_array_equal(sampler.batch_indices(step), sampler.batch_at(position)[0])
            assert sampler.position_of_step(step) == sampler.batch_start(position)
            position = sampler.batch_at(position)[2]
        # Count batches from a mid-epoch position until epoch 3 and compare with stepping.
        position, steps = 7, 0
        while sampler.epoch_of(position) < 3:
            position = sampler.batch_at(position)[2]
            steps += 1
        assert sampler.steps_until_epoch(7, 3) == steps


# --- resume -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_resume_at_every_step_equals_never_stopping(last_batch):
    sampler = IndexSampler(23, 6, seed=5, last_batch=last_batch)
    loader = BatchLoader(_arrays(23), sampler, transform=_noise, prefetch=0)
    total = 13  # crosses three epoch boundaries
    reference, _ = _run(loader, 0, total)
    for stop in range(total):
        head, position_at_stop = _run(loader, 0, stop)
        tail, _ = _run(BatchLoader(_arrays(23), sampler, transform=_noise, prefetch=1), position_at_stop,
                       total - stop, steps_per_call=3)
        _assert_same(head + tail, reference)


def test_batch_size_change_on_resume_continues_at_exact_sample():
    num_records = 100
    small = IndexSampler(num_records, 16, seed=9)
    large = IndexSampler(num_records, 32, seed=9)
    seen, position = [], 0
    for _ in range(3):
        indices, _, position = small.batch_at(position)
        seen += indices.tolist()
    assert position == 48
    # The checkpoint meta stores samples_consumed=48; the resumed run has batch 32.
    meta = data_meta(small, position)
    position = resume_position(meta, ignore_skip=False, skip_samples=None)
    indices, _, position = large.batch_at(position)
    seen += indices.tolist()
    assert position == 80
    np.testing.assert_array_equal(seen, large.record_indices(np.arange(80)))
    assert len(set(seen)) == 80  # nothing repeated, nothing skipped within the epoch
    # 20 samples remain in epoch 0, fewer than a batch: the next batch starts epoch 1.
    assert large.batch_at(position)[2] == 132
    assert data_meta(large, position, previous=meta)["global_batch_sizes"] == [16, 32]


def test_resume_position_ignore_skip_and_skip_samples():
    meta = {"samples_consumed": 480, "num_records": 100, "data_seed": 1}
    assert resume_position(meta, ignore_skip=False, skip_samples=None) == 480
    assert resume_position(meta, ignore_skip=True, skip_samples=None) == 0
    assert resume_position(meta, ignore_skip=True, skip_samples=17) == 17
    assert resume_position(meta, ignore_skip=False, skip_samples=0) == 0
    assert resume_position(None, ignore_skip=False, skip_samples=None) == 0
    with pytest.raises(DataError, match="skip_samples"):
        resume_position(meta, ignore_skip=False, skip_samples=-1)
    # The loader honours whatever position comes out: skip_samples=17 starts at stream sample 17.
    sampler = IndexSampler(100, 4, seed=1)
    batch, _ = BatchLoader(_arrays(100), sampler, prefetch=0).host_batch(17)
    np.testing.assert_array_equal(batch["y"], sampler.record_indices(np.arange(17, 21)))


def test_check_resume_meta_mismatch():
    meta = {"samples_consumed": 10, "num_records": 100, "data_seed": 1}
    check_resume(meta, 100, 1, ignore_skip=False)
    check_resume({"samples_consumed": 10}, 5, 7, ignore_skip=False)  # old/converted meta: nothing to compare
    with pytest.raises(DataError, match=r"100 records but the data now has 90.*data.ignore_skip=true"):
        check_resume(meta, 90, 1, ignore_skip=False)
    with pytest.raises(DataError, match=r"data seed 1 .* seed 2.*data.ignore_skip=true"):
        check_resume(meta, 100, 2, ignore_skip=False)
    check_resume(meta, 90, 2, ignore_skip=True)
    check_resume(meta, 90, 2, ignore_skip=False, skip_samples=0)


# --- processes --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_process_slices_concatenate_to_single_process_batch(last_batch):
    sampler = IndexSampler(50, 8, seed=4, last_batch=last_batch)
    single, _ = _run(BatchLoader(_arrays(50), sampler, transform=_noise, prefetch=0), 30, 5, steps_per_call=2)
    for processes in (2, 4):
        parts = [_run(BatchLoader(_arrays(50), sampler, process_index=p, process_count=processes,
                                  transform=_noise, prefetch=0), 30, 5, steps_per_call=2)
                 for p in range(processes)]
        assert len({end for _, end in parts}) == 1
        joined = [{k: np.concatenate([part[0][i][k] for part in parts]) for k in single[0]}
                  for i in range(len(single))]
        _assert_same(joined, single)


def test_to_global_single_process():
    import jax

    mesh = jax.make_mesh((1,), ("data",))
    batch = {"x": np.ones((2, 4, 3), np.float32), "weight": np.ones((2, 4), np.float32)}
    placed = to_global(batch, mesh)
    assert placed["x"].shape == (2, 4, 3) and isinstance(placed["weight"], jax.Array)
    np.testing.assert_array_equal(np.asarray(placed["x"]), batch["x"])


# --- sources and augmentation -----------------------------------------------------------------------------

def test_augmentation_replays_after_resume_and_differs_per_sample():
    sampler = IndexSampler(20, 4, seed=11)
    loader = BatchLoader(_arrays(20), sampler, transform=_noise, prefetch=0)
    first, _ = loader.host_batch(24)
    again, _ = BatchLoader(_arrays(20), sampler, transform=_noise, prefetch=0).host_batch(24)
    np.testing.assert_array_equal(first["x"], again["x"])
    # Same record in another epoch gets other noise; the rng is keyed by stream index, not record index.
    base = _arrays(20)["x"]
    noise = [first["x"][i] - base[first["y"][i]] for i in range(4)]
    assert len({tuple(n) for n in noise}) == 4
    position = next(g for g in range(40, 60) if sampler.order(g) == first["y"][0])
    other = loader.host_batch(position)[0]
    assert not np.allclose(other["x"][0] - base[other["y"][0]], noise[0])
    np.testing.assert_array_equal(sample_rng(11, 24).random(3), sample_rng(11, 24).random(3))


def test_record_sources_memmap_torch_grain_and_columnar(tmp_path):
    import grain
    import torch

    arrays = _arrays(12)
    expected = BatchLoader(arrays, IndexSampler(12, 4, seed=0), prefetch=0).host_batch(5)[0]

    path = tmp_path / "x.npy"
    np.save(path, arrays["x"])
    memmapped = {"x": np.load(path, mmap_mode="r"), "y": arrays["y"]}
    got = BatchLoader(memmapped, IndexSampler(12, 4, seed=0), prefetch=0).host_batch(5)[0]
    np.testing.assert_array_equal(got["x"], expected["x"])

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            return torch.from_numpy(arrays["x"][i]), torch.tensor(arrays["y"][i])

    got = BatchLoader(Pairs(), IndexSampler(12, 4, seed=0), keys=("x", "y"), prefetch=0).host_batch(5)[0]
    np.testing.assert_array_equal(got["x"], expected["x"])
    np.testing.assert_array_equal(got["y"], expected["y"])

    class HFLike:  # HF datasets.Dataset answers __getitems__ with a list of python-valued dicts
        def __len__(self):
            return 12

        def __getitem__(self, i):
            raise AssertionError("the batched __getitems__ should be used")

        def __getitems__(self, keys):
            return [{"x": arrays["x"][k].tolist(), "y": int(arrays["y"][k])} for k in keys]

    got = BatchLoader(HFLike(), IndexSampler(12, 4, seed=0), prefetch=0).host_batch(5)[0]
    np.testing.assert_array_equal(got["x"], expected["x"])

    got = BatchLoader(grain.sources.RangeDataSource(0, 12, 1), IndexSampler(12, 4, seed=0), keys=("y",),
                      prefetch=0).host_batch(5)[0]
    np.testing.assert_array_equal(got["y"], expected["y"])
    assert set(got) == {"y", "weight"}


# --- prefetch ---------------------------------------------------------------------------------------------

def test_prefetch_matches_synchronous_and_closes_cleanly():
    sampler = IndexSampler(40, 4, seed=6, last_batch="pad")
    sync, _ = _run(BatchLoader(_arrays(40), sampler, transform=_noise, prefetch=0), 3, 25, steps_per_call=4)
    threads_before = threading.active_count()
    ahead, _ = _run(BatchLoader(_arrays(40), sampler, transform=_noise, prefetch=3), 3, 25, steps_per_call=4)
    _assert_same(ahead, sync)
    # Closing an endless iterator mid-stream (with a full queue) ends its thread.
    calls = BatchLoader(_arrays(40), sampler, prefetch=2).iter_from(0, steps_per_call=2)
    next(calls)
    calls.close()
    assert not calls.alive and threading.active_count() == threads_before
    with pytest.raises(StopIteration):
        next(calls)


def test_prefetch_surfaces_source_errors():
    class Broken:
        def __len__(self):
            return 8

        def __getitem__(self, i):
            raise OSError("disk gone")

    with BatchLoader(Broken(), IndexSampler(8, 2, seed=0), prefetch=2).iter_from(0) as calls:
        with pytest.raises(OSError, match="disk gone"):
            next(calls)


# --- errors -----------------------------------------------------------------------------------------------

def _one_line_error(match: str, build) -> None:
    with pytest.raises(DataError, match=match) as raised:
        build()
    assert "\n" not in str(raised.value)


def test_data_errors_name_the_problem_and_fix():
    _one_line_error("empty", lambda: ArraySource({"x": np.zeros((0, 3))}))
    _one_line_error("empty", lambda: RecordSource([]))
    _one_line_error("empty", lambda: IndexSampler(0, 4, seed=0))
    _one_line_error(r"global_batch_size=11 is larger than the dataset \(10 records\).*data.last_batch=pad",
                    lambda: IndexSampler(10, 11, seed=0, last_batch="drop"))
    IndexSampler(10, 11, seed=0, last_batch="pad")  # allowed: the filler has weight 0
    _one_line_error("not divisible by the 4 processes; set it to a multiple of 4",
                    lambda: BatchLoader(_arrays(10), IndexSampler(10, 6, seed=0), process_index=0, process_count=4))
    _one_line_error("different numbers of records", lambda: ArraySource({"x": np.zeros((3, 2)), "y": np.zeros(4)}))
    _one_line_error("has 10 records but the sampler was built for 12",
                    lambda: BatchLoader(_arrays(10), IndexSampler(12, 2, seed=0)))
    _one_line_error("keys=", lambda: BatchLoader([(1, 2)] * 4, IndexSampler(4, 2, seed=0), prefetch=0).host_batch(0))
    _one_line_error("negative", lambda: IndexSampler(4, 2, seed=0).batch_at(-1))
