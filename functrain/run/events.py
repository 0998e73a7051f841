"""``RUN_DIR/events.jsonl``: when a run started, resumed or was rewound, one JSON object per line.

``metrics.jsonl`` keeps only metrics (tests and tools compare it line by line across resumes); the moments
between its lines live here: ``{"event": "start" | "resume" | "rewind", "step": .., "time": ..}`` plus
details. ``functrain plot`` marks resumes from it and the end-of-run summary takes the wall time from it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from functrain.run.callbacks import Callback, RunView

EVENTS_FILE = "events.jsonl"


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


class RunEvents(Callback):
    """Records each start of training: ``start`` at step 0, ``resume`` from a checkpoint (primary only)."""

    def on_train_begin(self, view: RunView) -> None:
        if view.is_primary:
            append_event(
                view.run_dir,
                "resume" if view.start_step else "start",
                view.start_step,
                samples_consumed=view.samples_consumed,
            )
