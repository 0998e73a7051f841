"""The run summary names what a newcomer looks for: the weights a run began with, a preference run's rewards."""

import json

from functrain.callbacks.view import RunRecord, RunView
from functrain.report.summary import summary_lines


def test_the_summary_names_the_source_run_and_a_preference_runs_rewards(tmp_path):
    lines = [{"step": step, "split": "eval", "loss": 0.7 - step / 1000, "rewards/margins": step / 100,
              "rewards/accuracies": 0.5 + step / 1000} for step in (100, 200)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    record = RunRecord(config=None, run_dir=tmp_path, max_steps=200, is_primary=True, step=200,
                       samples_consumed=6400, started_from="runs/char_gpt at step 500", stop_reason="finished")
    text = "\n".join(summary_lines(RunView(record), 13.0, None))
    assert "started from the weights of runs/char_gpt at step 500 (train.init_from)" in text
    assert "eval rewards/margins: last 2 at step 200, best 2 at step 200" in text
    assert "eval rewards/accuracies: last 0.7 at step 200" in text and "eval loss: last 0.5 at step 200" in text
