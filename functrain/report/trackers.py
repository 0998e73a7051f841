"""Experiment trackers beyond metrics.jsonl and TensorBoard: ``log.trackers: [..., wandb, mlflow]``.

Each tracker logs the resolved config once, every logged metric (``train/loss``, ``eval/loss``, ...) at its
step, and each checkpoint step (``checkpoint/step``). The tracker's run id is kept in
``RUN_DIR/trackers.json``, so a resumed run continues the same W&B / MLflow run. W&B follows its own
settings (``WANDB_MODE=offline`` writes under ``RUN_DIR/wandb`` with no account); MLflow logs to
``MLFLOW_TRACKING_URI`` when set, else to a file store in ``RUN_DIR/mlruns`` (no server, no database).
Only the primary process logs. W&B keeps steps increasing: after a crash past the last checkpoint, the
resumed run's first steps (already logged once) are dropped by W&B; metrics.jsonl sets them aside.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.core.tree import flatten_dotted
from functrain.errors import ConfigError

RUN_IDS_FILE = "trackers.json"
EXPERIMENT = "functrain"
# MLflow's file store writes a file per metric per call: batch the points and write them this often.
MLFLOW_FLUSH_SECONDS = 5.0


def _require(package: str, extra: str) -> Any:
    """Import ``package`` or raise a ConfigError naming the extra to install."""
    try:
        return __import__(package)
    except ImportError:
        raise ConfigError(
            f"log.trackers lists {extra} but the {package} package is not installed; "
            f"pip install 'functrain[{extra}]' or remove {extra} from log.trackers"
        ) from None


def saved_run_id(run_dir: Path, tracker: str) -> str | None:
    """The id of the tracker run a previous session of this run logged to."""
    path = run_dir / RUN_IDS_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(tracker)
    except (ValueError, AttributeError):
        return None


def save_run_id(run_dir: Path, tracker: str, run_id: str) -> None:
    """Record ``tracker``'s run id in ``RUN_DIR/trackers.json`` (written atomically)."""
    path = run_dir / RUN_IDS_FILE
    ids = json.loads(path.read_text()) if path.is_file() else {}
    ids[tracker] = run_id
    tmp = path.with_name(f".{RUN_IDS_FILE}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(ids, indent=1))
    tmp.replace(path)


def _finite(metrics: dict[str, float], split: str) -> dict[str, float]:
    return {f"{split}/{name}": float(value) for name, value in metrics.items() if math.isfinite(value)}


class WandbTracker(Callback):
    """Weights & Biases: one W&B run per functrain run, resumed by id."""

    def __init__(self) -> None:
        self.wandb = _require("wandb", "wandb")
        self.run = None

    def on_train_begin(self, view: RunView) -> None:
        if not view.is_primary:
            return
        run_id = saved_run_id(view.run_dir, "wandb") or uuid.uuid4().hex[:12]
        self.run = self.wandb.init(
            project=EXPERIMENT,
            name=view.run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(view.run_dir),
            config=view.config.to_dict(),
            settings=self.wandb.Settings(silent=True, console="off"),
        )
        save_run_id(view.run_dir, "wandb", run_id)

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(_finite(metrics, split), step=step)

    def on_save(self, view: RunView, step: int) -> None:
        if self.run is not None:
            self.run.log({"checkpoint/step": step}, step=step)

    def on_train_end(self, view: RunView) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MlflowTracker(Callback):
    """MLflow: one MLflow run per functrain run (experiment ``functrain``), resumed by id."""

    def __init__(self) -> None:
        self.mlflow = _require("mlflow", "mlflow")
        self.client: Any = None  # an MlflowClient, made when training begins (process 0)
        self.run_id: str | None = None
        self.pending: list[Any] = []
        self.flushed_at = 0.0

    def on_train_begin(self, view: RunView) -> None:
        if not view.is_primary:
            return
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (view.run_dir / "mlruns").absolute().as_uri()
            # MLflow 3 keeps the file store behind an opt-in; it is the store that needs no server or database.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        self.run_id = saved_run_id(view.run_dir, "mlflow")
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(EXPERIMENT)
            experiment_id = (
                experiment.experiment_id if experiment is not None else self.client.create_experiment(EXPERIMENT)
            )
            self.run_id = self.client.create_run(experiment_id, run_name=view.run_dir.name).info.run_id
            # Params cannot change within an MLflow run: the config is logged when the run is created.
            params = [
                Param(key, json.dumps(value)[:6000]) for key, value in flatten_dotted(view.config.to_dict()).items()
            ]
            self.client.log_batch(self.run_id, params=params)
            save_run_id(view.run_dir, "mlflow", self.run_id)
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        self.flushed_at = time.monotonic()

    def _add(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(key, value, now, step) for key, value in metrics.items()]
        if time.monotonic() - self.flushed_at > MLFLOW_FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write the batched metric points."""
        for start in range(0, len(self.pending), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=self.pending[start : start + 1000])
        self.pending, self.flushed_at = [], time.monotonic()

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.client is not None:
            self._add(_finite(metrics, split), step)

    def on_save(self, view: RunView, step: int) -> None:
        if self.client is not None:
            self._add({"checkpoint/step": float(step)}, step)
            self.flush()

    def on_train_end(self, view: RunView) -> None:
        if self.client is not None:
            self.flush()
            self.client.set_terminated(self.run_id, status="FINISHED")
            self.client = None


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def make_trackers(names: Sequence[str]) -> list[Callback]:
    """The tracker callbacks named in ``log.trackers`` (``jsonl`` and ``tensorboard`` are the built-in
    :class:`~functrain.report.metrics.MetricsWriter`); a missing package is a ConfigError naming its extra."""
    return [TRACKERS[name]() for name in dict.fromkeys(names) if name in TRACKERS]
