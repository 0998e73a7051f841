"""``RUN_DIR/metrics.jsonl`` and the TensorBoard event files: every metric the run logs, one JSON line each."""

import json
import math
from pathlib import Path
from typing import Any, TextIO

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.report.tensorboard import summary_writer

METRICS_FILE = "metrics.jsonl"
TAIL_BYTES = 1 << 16  # what last_logged_step reads: many lines of the longest metric records


def _json_safe(value: float) -> float | None:
    """JSON has no NaN/inf: write them as null so every line stays valid JSON."""
    return value if math.isfinite(value) else None


def last_logged_step(path: Path) -> int:
    """The step of the last whole line of a metrics file (0 when it has none): how far its history got. Only the
    file's tail is read; a line cut short by a kill is skipped."""
    if not path.is_file():
        return 0
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(size - TAIL_BYTES, 0))
        tail = f.read().decode(errors="replace").splitlines()
    if size > TAIL_BYTES:
        tail = tail[1:]  # the first line read may be the end of a longer one
    for line in reversed(tail):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def set_aside_lines_after(path: Path, step: int) -> None:
    """Move records of steps after ``step`` (logged by a run that crashed after its last checkpoint) to
    ``<name>.abandoned.jsonl``, so the file holds one line of history; nothing is deleted."""
    keep: list[str] = []
    abandoned: list[str] = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            later = json.loads(line)["step"] > step
        except (ValueError, KeyError, TypeError):
            later = False
        (abandoned if later else keep).append(line)
    if not abandoned:
        return
    with open(path.with_suffix(".abandoned.jsonl"), "a") as aside:
        aside.writelines(abandoned)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    tmp.replace(path)


class MetricsWriter(Callback):
    """Appends every logged and evaluated metric to ``metrics.jsonl`` and TensorBoard event files."""

    def __init__(self, tensorboard: bool = True) -> None:
        self.tensorboard = tensorboard
        self.jsonl: TextIO | None = None
        self.writer: Any = None  # a tensorboardX SummaryWriter

    def on_train_begin(self, view: RunView) -> None:
        if not view.is_primary:
            return
        path = view.run_dir / METRICS_FILE
        if path.exists():
            set_aside_lines_after(path, view.start_step)
        self.jsonl = open(path, "a", buffering=1)  # noqa: SIM115 -- held for the run; on_train_end closes it
        if self.tensorboard:
            self.writer = summary_writer(str(view.run_dir / "tensorboard"))

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.jsonl is None:
            return
        record = {"step": step, "split": split}
        record.update({name: _json_safe(value) for name, value in metrics.items()})
        self.jsonl.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for name, value in metrics.items():
                self.writer.add_scalar(f"{split}/{name}", value, step)

    def on_train_end(self, view: RunView) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
