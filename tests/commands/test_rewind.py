"""``functrain rewind``: back to a checkpoint, exactly K samples skipped, kept on a later plain resume; bad
requests are one line, exit 2, and change nothing in the run directory."""

import json

from functrain.checkpoint import list_checkpoints
from functrain.commands.cli import main
from functrain.run.fit import fit
from tests.commands.test_cli import snapshot

BATCH = 64
TINY = {"train.steps_per_call": 1, "log.every_steps": 1, "checkpoint.every_steps": 4, "eval.every_steps": 0,
        "log.progress": False, "data.global_batch_size": BATCH}


def positions(run_dir, name="metrics.jsonl") -> dict[int, int]:
    lines = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
    return {line["step"]: line["samples_consumed"] for line in lines if line["split"] == "train"}


def test_rewind_skips_exactly_k_samples_and_a_plain_resume_keeps_them_skipped(tmp_path):
    run_dir = tmp_path / "run"
    fit("configs/mlp_digits.yaml", **TINY, **{"run.dir": str(run_dir), "train.max_steps": 12})
    skip = 3 * BATCH + 5
    assert main(["rewind", str(run_dir), "--to", "4", "--skip-samples", str(skip)]) == 0

    # Steps 5.. consumed their batch after the K skipped samples; the old history is set aside, not lost.
    assert positions(run_dir) == {s: s * BATCH + (skip if s > 4 else 0) for s in range(1, 13)}
    assert positions(run_dir, "metrics.abandoned.jsonl") == {s: s * BATCH for s in range(5, 13)}
    assert sorted(p.name for p in (run_dir / "checkpoints.abandoned").iterdir()) == ["12", "8"]
    newest = list_checkpoints(run_dir, verify=False)[-1]
    assert newest.step == 12 and newest.meta["samples_consumed"] == 12 * BATCH + skip
    assert newest.meta["position_jumps"] == [{"step": 4, "from": 4 * BATCH, "to": 4 * BATCH + skip}]

    # A plain resume with the original config continues the rewound history.
    fit("configs/mlp_digits.yaml", **TINY, **{"run.dir": str(run_dir), "train.max_steps": 16})
    assert positions(run_dir)[16] == 16 * BATCH + skip
    newest = list_checkpoints(run_dir, verify=False)[-1]
    assert newest.step == 16 and newest.meta["position_jumps"] == [{"step": 4, "from": 4 * BATCH,
                                                                    "to": 4 * BATCH + skip}]

    # Bad requests: past the newest checkpoint, a step without one, a negative count.
    before = snapshot(run_dir)
    for step, count in ((20, 10), (6, 10), (4, -1)):
        assert main(["rewind", str(run_dir), "--to", str(step), "--skip-samples", str(count)]) == 2
    assert snapshot(run_dir) == before
