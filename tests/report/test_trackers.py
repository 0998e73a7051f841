"""Experiment trackers: W&B (offline) and MLflow (file store) hold the run's config, metrics and checkpoint
steps, a resumed run continues the same tracker run, and a tracker whose package is missing is one line
naming the extra, with nothing written."""

import json
import struct
import sys
from pathlib import Path

import pytest

from functrain.commands.cli import main
from tests.conftest import run_python
from functrain.run.fit import fit

TINY = {"train.steps_per_call": 1, "log.every_steps": 2, "checkpoint.every_steps": 4, "eval.every_steps": 8,
        "log.progress": False, "log.trackers": ["jsonl", "wandb", "mlflow"]}


def wandb_records(path: Path):
    """The protobuf records of an offline ``.wandb`` file (W&B's LevelDB-style log: 32 KiB blocks of chunks
    with a 7-byte header: crc32, length, type 1=full 2=first 3=middle 4=last)."""
    from wandb.proto import wandb_internal_pb2  # here: wandb and mlflow cost a worker that runs none of this 2 s

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending = 32768, 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_dir: Path) -> list[tuple[str, dict[str, float]]]:
    """(run id, logged values) per logged step, over every offline session of the run, oldest first."""
    rows = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):
        run_id = None
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                rows.append((run_id, {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                      for item in record.history.item}))
    return rows


def test_wandb_offline_and_mlflow_file_store_follow_a_resumed_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    fit("configs/mlp_digits.yaml", **TINY, **{"run.dir": str(run_dir), "train.max_steps": 8})
    first_ids = json.loads((run_dir / "trackers.json").read_text())
    fit("configs/mlp_digits.yaml", **TINY, **{"run.dir": str(run_dir), "train.max_steps": 16})
    assert json.loads((run_dir / "trackers.json").read_text()) == first_ids

    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_loss = {line["step"]: line["loss"] for line in logged if line["split"] == "train"}
    assert sorted(train_loss) == list(range(2, 17, 2))

    history = wandb_history(run_dir)
    assert len(list(run_dir.glob("wandb/offline-run-*"))) == 2  # two sessions ...
    assert {run_id for run_id, _ in history} == {first_ids["wandb"]}  # ... of one W&B run
    wandb_loss = {row["_step"]: row["train/loss"] for _, row in history if "train/loss" in row}
    assert wandb_loss == pytest.approx(train_loss)
    assert [row["checkpoint/step"] for _, row in history if "checkpoint/step" in row] == [4, 8, 12, 16]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run = client.get_run(first_ids["mlflow"])
    assert run.data.params["model.name"] == '"mlp"' and run.info.status == "FINISHED"
    mlflow_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert mlflow_loss == pytest.approx(train_loss)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "checkpoint/step")) == [4, 8, 12, 16]
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_without_its_package_is_one_line_naming_the_extra(tracker, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` now raises ImportError
    run_dir = tmp_path / "run"
    status = main(["train", "configs/mlp_digits.yaml", f"run.dir={run_dir}", f"log.trackers=[jsonl,{tracker}]"])
    assert status == 2
    assert f"pip install 'functrain[{tracker}]'" in capsys.readouterr().err
    assert not run_dir.exists()


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a run's TensorBoard event files (TFRecords: a u64 length, its crc, the Event, its crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, position = path.read_bytes(), 0
        while position < len(data):
            (length,) = struct.unpack("<Q", data[position:position + 8])
            event = Event.FromString(data[position + 12:position + 12 + length])
            position += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_run_on_the_bundled_digits_writes_tensorboard_scalars_without_importing_torch_or_sklearn(tmp_path):
    # Both are installed here; neither is needed to train on the bundled data and log to TensorBoard, and each
    # cost about 1.7 s of start-up.
    proc = run_python(f"""
        import json, sys
        from functrain.commands.cli import main
        code = main(["train", "configs/mlp_digits.yaml", "run.dir={tmp_path}", "train.max_steps=4",
                     "train.steps_per_call=2", "log.every_steps=2", "eval.every_steps=4", "log.progress=false"])
        print("RESULT", json.dumps({{"code": code, "loaded": sorted({{"torch", "sklearn"}} & set(sys.modules))}}))
        """)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"code": 0, "loaded": []}
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scalars = tensorboard_scalars(tmp_path)
    expected = [(row["step"], row["loss"]) for row in logged if row["split"] == "train"]
    assert [step for step, _ in expected] == [2, 4]
    assert [step for step, _ in scalars["train/loss"]] == [2, 4]
    assert [value for _, value in scalars["train/loss"]] == pytest.approx([loss for _, loss in expected], rel=1e-6)
    assert [step for step, _ in scalars["eval/loss"]] == [4]
