"""data.name: synthetic: random token ids that need no corpus, deterministic in (seed, record)."""

import json

import numpy as np
import pytest

from functrain import fit
from functrain.data.synthetic import NUM_RECORDS, SyntheticTokens, synthetic_splits
from functrain.errors import DataError


def test_records_are_a_function_of_seed_and_index_in_the_vocabulary_range():
    source = SyntheticTokens(seq_len=16, vocab_size=1000, seed=3)
    batch = source.gather(np.array([5, 0, 7]))["tokens"]
    assert batch.shape == (3, 17) and batch.dtype == np.int32
    assert batch.min() >= 0 and batch.max() < 1000
    # The same record whatever else is gathered with it, and in any order.
    np.testing.assert_array_equal(source.gather(np.array([7]))["tokens"][0], batch[2])
    np.testing.assert_array_equal(SyntheticTokens(16, 1000, 3).gather(np.array([0, 5]))["tokens"], batch[[1, 0]])
    other_seed = SyntheticTokens(16, 1000, 4).gather(np.array([5, 0, 7]))["tokens"]
    assert (other_seed != batch).mean() > 0.9
    assert len(np.unique(batch)) > 40  # not a constant or a short cycle


def test_splits_cover_the_documented_number_of_records_without_overlap():
    train, evaluation = synthetic_splits(8, 50, seed=0, eval_fraction=0.01)
    assert len(train) + len(evaluation) == NUM_RECORDS
    np.testing.assert_array_equal(evaluation.gather(np.array([0]))["tokens"],
                                  SyntheticTokens(8, 50, 0).gather(np.array([len(train)]))["tokens"])
    assert synthetic_splits(8, 50, seed=0, eval_fraction=0.0)[1] is None
    with pytest.raises(DataError, match="model.vocab_size"):
        synthetic_splits(8, None, seed=0, eval_fraction=0.0)


def test_a_gpt_trains_on_synthetic_data_and_its_loss_is_near_log_vocab(tmp_path):
    fit("configs/char_gpt.yaml", **{"run.dir": str(tmp_path / "r"), "data.name": "synthetic", "train.max_steps": 4,
                                    "train.steps_per_call": 2, "log.every_steps": 2, "eval.every_steps": 4,
                                    "eval.max_batches": 1, "eval.samples.count": 0, "checkpoint.every_steps": 0,
                                    "model.d_model": 32, "model.d_ff": 64, "model.n_layers": 1, "log.plot": False,
                                    "data.seq_len": 16, "data.global_batch_size": 4, "log.progress": False})
    lines = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    evaluation = [line for line in lines if line["split"] == "eval"]
    assert evaluation and abs(evaluation[-1]["loss"] - np.log(256)) < 0.5
