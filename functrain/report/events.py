"""``RUN_DIR/events.jsonl``: when a run started, resumed or was rewound, one JSON object per line.

``metrics.jsonl`` keeps only metrics (tests and tools compare it line by line across resumes); the moments
between its lines live here: ``{"event": "start" | "resume" | "rewind" | "progress" | "end", "step": ..,
"time": ..}`` plus details. ``functrain plot`` marks resumes from it; the goodput report
(:mod:`functrain.report.goodput`) reads the seconds each session spent where: ``start``/``resume`` carry when the
session started (its process's start, for the first ``fit`` of a process), where the start came from
(``source``: local, peer or persistent), the last step ``metrics.jsonl`` held then (``reached_before``: how far
the previous session got, its log lines after its own last event included) and, for a supervisor's restart, how
the previous attempt ended;
``progress`` (each save, and train log steps at most every :data:`PROGRESS_EVERY_S`) and ``end`` carry the
session's running totals.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.guards.restarts import ENV_PREVIOUS_EXIT
from functrain.report.metrics import METRICS_FILE, last_logged_step

EVENTS_FILE = "events.jsonl"
PROGRESS_EVERY_S = 30.0  # the most often a train log step writes a progress line


def append_event(run_dir: str | os.PathLike, event: str, step: int, **details: Any) -> None:
    """Append one event line to ``RUN_DIR/events.jsonl``."""
    record = {"event": event, "step": int(step), "time": time.time(), **details}
    with open(Path(run_dir) / EVENTS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_events(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The events of a run, oldest first (none when the file is missing; unreadable lines are skipped)."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "event" in record and "step" in record:
            events.append(record)
    return events


def history_started(run_dir: str | os.PathLike) -> float | None:
    """When the run directory's current line of history began: the time of its newest ``start`` (a fresh start)
    or ``rewind`` event; None before it has one."""
    starts = [float(e["time"]) for e in read_events(run_dir) if e["event"] in ("start", "rewind") and "time" in e]
    return starts[-1] if starts else None


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {name: round(value, 3) for name, value in seconds.items()}


class RunEvents(Callback):
    """Records each start of training (``start`` at step 0, ``resume`` from a checkpoint), its progress at train
    log steps and saves, and its end (primary only). It comes before :class:`~functrain.report.metrics.MetricsWriter`
    in a run's callbacks: a start reads how far ``metrics.jsonl`` got before the writer sets aside the lines past
    the resumed step."""

    def __init__(self) -> None:
        self._startup = 0.0
        self._last_progress = 0.0  # when the last progress line was written

    def on_train_begin(self, view: RunView) -> None:
        if not view.is_primary:
            return
        started = view.session_started
        seconds = dict(view.time_spent)
        # Start-up: everything from the session's start to here but the restore and the compiling.
        elapsed = time.time() - started
        seconds["startup"] = max(elapsed - seconds.get("restore", 0.0) - seconds.get("compile", 0.0), 0.0)
        restart = os.environ.get(ENV_PREVIOUS_EXIT)
        append_event(
            view.run_dir,
            "resume" if view.start_step else "start",
            view.start_step,
            samples_consumed=view.samples_consumed,
            session_started=started,
            source=view.restore_source,
            reached_before=last_logged_step(view.run_dir / METRICS_FILE),
            seconds=_rounded(seconds),
            **({"restart_after": restart} if restart else {}),
        )
        self._startup = seconds["startup"]

    def _progress(self, view: RunView, event: str, step: int, **details: Any) -> None:
        self._last_progress = time.time()
        if view.is_primary:
            seconds = {**view.time_spent, "startup": self._startup}
            append_event(view.run_dir, event, step, seconds=_rounded(seconds), **details)

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        # At most one line per PROGRESS_EVERY_S from log steps (saves always write one): a run that logs every
        # step does not grow a line per step; a kill loses the time since the last line to "down" in the report.
        if split == "train" and time.time() - self._last_progress >= PROGRESS_EVERY_S:
            self._progress(view, "progress", step)

    def on_save(self, view: RunView, step: int) -> None:
        self._progress(view, "progress", step)

    def on_train_end(self, view: RunView) -> None:
        kind = view.stop_kind.value if view.stop_kind is not None else None
        self._progress(view, "end", view.step, stop_kind=kind)
