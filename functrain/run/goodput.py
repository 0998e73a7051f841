"""Goodput: how much of a run's wall time trained it, and where the rest went.

While a session runs, :class:`TimeSpent` adds up the seconds the loop spends restoring, evaluating and saving,
each without the compiling that happened inside it (compiling is its own bin, from JAX's monitoring events), and
:class:`~functrain.run.events.RunEvents` writes the totals into ``events.jsonl`` at saves, log steps and the end.
From those lines alone (a session killed with SIGKILL leaves its last ones), :func:`goodput_of` splits the wall
time from the first process start to the last event into productive step time and what was lost:

* start-up: process start to the first step but for restoring and compiling (imports, data, building);
* compile, restore, eval, save: as measured;
* retrained: steps a session computed past the step the next session resumed from, at that session's pace;
* down: from a session's last event to the next one's process start (the time a crash lost unrecorded, the
  restart's pause, the queue).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import psutil

# The bins measured in a session, in the order the report lists them.
MEASURED = ("startup", "compile", "restore", "eval", "save")
LOST = (*MEASURED, "retrained", "down")


def process_start_time() -> float:
    """When this process started (seconds since the epoch)."""
    return psutil.Process().create_time()


class TimeSpent:
    """Seconds per activity of one session, compile time kept apart from the activity it happened in.

    ``started``: when the session began (seconds since the epoch); ``compiled_before``: the process's compile
    seconds then, so that a second ``fit`` in one process counts only its own."""

    def __init__(
        self, compile_seconds: Callable[[], float], started: float | None = None, compiled_before: float = 0.0
    ) -> None:
        self.started = time.time() if started is None else started
        self._compile_seconds = compile_seconds
        self._compiled_before = compiled_before
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def measure(self, activity: str) -> Iterator[None]:
        """Add the time spent inside the block, less the compiling inside it, to ``activity``."""
        started, compiled = time.perf_counter(), self._compile_seconds()
        try:
            yield
        finally:
            compiling = self._compile_seconds() - compiled
            self._seconds[activity] += time.perf_counter() - started - compiling

    def totals(self) -> dict[str, float]:
        """Seconds per activity so far, ``compile`` (all of the session's) included."""
        return {**self._seconds, "compile": self._compile_seconds() - self._compiled_before}


_process_had_a_session = False


def session_time_spent(compile_seconds: Callable[[], float]) -> TimeSpent:
    """The :class:`TimeSpent` of a session starting now. The first session of a process began when the process
    did (its imports are start-up); a later one (``fit`` called again) begins now."""
    global _process_had_a_session
    if _process_had_a_session:
        return TimeSpent(compile_seconds, time.time(), compile_seconds())
    _process_had_a_session = True
    return TimeSpent(compile_seconds, process_start_time())


@dataclass
class Session:
    """One process start of a run, as its events tell it."""

    started: float
    first_step: int
    last_step: int
    last_time: float
    seconds: dict[str, float]  # startup, compile, restore, eval, save
    source: str | None = None  # where its start came from: local, peer, persistent (None: fresh)
    restart: str | None = None  # how the previous attempt ended, when a supervisor restarted it
    ended: str | None = None  # the stop kind, when it ended on its own

    @property
    def wall(self) -> float:
        return max(self.last_time - self.started, 0.0)


@dataclass
class Goodput:
    """A run's wall time split into productive step time and what was lost (seconds)."""

    wall: float = 0.0
    productive: float = 0.0
    lost: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LOST, 0.0))
    retrained_steps: int = 0
    sessions: list[Session] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        """Productive over wall time."""
        return self.productive / self.wall if self.wall > 0 else 0.0


def sessions_of(events: Sequence[Mapping[str, Any]]) -> list[Session]:
    """The sessions of a run from its events (``start``/``resume`` open one; ``progress``/``end`` extend it)."""
    sessions: list[Session] = []
    for event in events:
        kind, step, when = event["event"], int(event["step"]), float(event.get("time", 0.0))
        if kind in ("start", "resume"):
            sessions.append(
                Session(
                    started=float(event.get("session_started", when)),
                    first_step=step,
                    last_step=step,
                    last_time=when,
                    seconds=dict(event.get("seconds") or {}),
                    source=event.get("source"),
                    restart=event.get("restart_after"),
                )
            )
        elif kind in ("progress", "end") and sessions:
            session = sessions[-1]
            session.last_step, session.last_time = max(session.last_step, step), max(session.last_time, when)
            session.seconds.update({name: value for name, value in (event.get("seconds") or {}).items()})
            if kind == "end":
                session.ended = event.get("stop_kind")
    return sessions


def goodput_of(events: Sequence[Mapping[str, Any]]) -> Goodput:
    """The :class:`Goodput` of a run from its ``events.jsonl`` lines."""
    sessions = sessions_of(events)
    result = Goodput(sessions=sessions)
    if not sessions:
        return result
    result.wall = sessions[-1].last_time - sessions[0].started
    for index, session in enumerate(sessions):
        for name in MEASURED:
            result.lost[name] += float(session.seconds.get(name, 0.0))
        if index:
            previous = sessions[index - 1]
            result.lost["down"] += max(session.started - previous.last_time, 0.0)
            redone = max(previous.last_step - session.first_step, 0)
            if redone:
                result.retrained_steps += redone
                result.lost["retrained"] += redone * _seconds_per_step(previous)
    result.productive = max(result.wall - sum(result.lost.values()), 0.0)
    return result


def _seconds_per_step(session: Session) -> float:
    steps = session.last_step - session.first_step
    busy = session.wall - sum(float(session.seconds.get(name, 0.0)) for name in MEASURED)
    return max(busy, 0.0) / steps if steps > 0 else 0.0


def _duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}min"


def goodput_lines(result: Goodput) -> list[str]:
    """The report: productive share, what was lost by cause, and each later session (a restart or a rerun) with
    the step it resumed from and where that step came from."""
    if not result.sessions:
        return ["goodput: no events recorded (events.jsonl is missing or empty)"]
    sessions = len(result.sessions)
    lines = [f"goodput {result.fraction:.0%}: {_duration(result.productive)} of steps in {_duration(result.wall)}"]
    lines[0] += f" over {sessions} session(s)"
    lost = [
        f"{name} {_duration(seconds)}" + (f" ({result.retrained_steps} steps)" if name == "retrained" else "")
        for name, seconds in result.lost.items()
        if seconds >= 0.05 or (name == "retrained" and result.retrained_steps)
    ]
    lines.append(f"lost: {', '.join(lost) if lost else 'nothing measurable'}")
    for number, session in enumerate(result.sessions[1:], start=2):
        restarted = f", restarted after {session.restart}" if session.restart else ""
        lines.append(
            f"session {number}{restarted}: resumed from step {session.first_step} "
            f"({session.source or 'fresh start'}), reached step {session.last_step}"
        )
    return lines


def goodput_report(run_dir: str | Path) -> str:
    """``functrain inspect RUN_DIR --goodput``: the report of a run directory's ``events.jsonl``."""
    from functrain.run.events import read_events

    return "\n".join(goodput_lines(goodput_of(read_events(run_dir))))
