"""Goodput: how much of a run's wall time trained it, and where the rest went.

While a session runs, :class:`~functrain.callbacks.time_spent.TimeSpent` adds up the seconds the loop spends
restoring, evaluating and saving, each without the compiling that happened inside it (compiling is its own bin,
from JAX's monitoring events), and :class:`~functrain.report.events.RunEvents` writes the totals into
``events.jsonl`` at saves, log steps and the end.
From those lines alone (a session killed with SIGKILL leaves its last ones), :func:`goodput_of` splits the wall
time from the first process start to the last event into productive step time and what was lost:

* start-up: process start to the first step but for restoring and compiling (imports, data, building);
* compile, restore, eval, save: as measured;
* retrained: steps a session computed past the step the next session resumed from, at that session's pace; how
  far it got is the furthest of its last event and the last step ``metrics.jsonl`` held when the next session
  started (its ``reached_before``: the log lines a killed session wrote after its last event);
* down: from a session's last event to the next one's process start, less the steps it ran in that time (the time
  a crash lost unrecorded, the restart's pause, the queue).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from functrain.report.events import read_events

# The bins measured in a session, in the order the report lists them.
MEASURED = ("startup", "compile", "restore", "eval", "save")
LOST = (*MEASURED, "retrained", "down")


@dataclass
class Session:
    """One process start of a run, as its events tell it."""

    started: float
    first_step: int
    last_step: int
    last_time: float
    seconds: dict[str, float]  # startup, compile, restore, eval, save
    reached: int = 0  # the furthest step it computed: its last event's, or a later step it logged after it
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
            if sessions:  # the lines a session killed after its last event logged tell how far it got
                sessions[-1].reached = max(sessions[-1].reached, int(event.get("reached_before") or 0))
            sessions.append(
                Session(
                    started=float(event.get("session_started", when)),
                    first_step=step,
                    last_step=step,
                    last_time=when,
                    seconds=dict(event.get("seconds") or {}),
                    source=event.get("source"),
                    restart=event.get("restart_after"),
                    reached=step,
                )
            )
        elif kind in ("progress", "end") and sessions:
            session = sessions[-1]
            session.last_step, session.last_time = max(session.last_step, step), max(session.last_time, when)
            session.reached = max(session.reached, session.last_step)
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
            redone = _redone(sessions[index - 1], session)
            result.retrained_steps += redone.steps
            result.lost["retrained"] += redone.seconds
            result.lost["down"] += redone.down
    result.productive = max(result.wall - sum(result.lost.values()), 0.0)
    return result


@dataclass
class _Redone:
    steps: int  # steps the previous session computed past the step this one resumed from
    seconds: float  # their time, at the previous session's pace
    down: float  # the time between the two sessions that ran no step


def _redone(previous: Session, session: Session) -> _Redone:
    """What ``previous`` computed that ``session`` computes again, and the time between them that ran nothing.

    A session killed between two events logged steps after its last one: they ran in what looks like the gap
    between the sessions (the part of it they took is work, not down time), and those past the resumed step are
    computed again."""
    pace = _seconds_per_step(previous)
    gap = max(session.started - previous.last_time, 0.0)
    reached = previous.reached
    in_gap = min((reached - previous.last_step) * pace, gap)  # the steps run after the last event
    recorded = max(previous.last_step - session.first_step, 0)  # recomputed steps before the last event
    unrecorded = max(reached - max(previous.last_step, session.first_step), 0)  # ... and after it
    unrecorded_seconds = in_gap * unrecorded / (reached - previous.last_step) if unrecorded else 0.0
    return _Redone(recorded + unrecorded, recorded * pace + unrecorded_seconds, gap - in_gap)


def _seconds_per_step(session: Session) -> float:
    steps = session.last_step - session.first_step
    busy = session.wall - sum(float(session.seconds.get(name, 0.0)) for name in MEASURED)
    return max(busy, 0.0) / steps if steps > 0 else 0.0


def _duration(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.1f}min"


def goodput_lines(result: Goodput) -> list[str]:
    """The report: productive share, what was lost by cause, the steps computed again after restarts, and each
    later session (a restart or a rerun) with the step it resumed from and where that step came from."""
    if not result.sessions:
        return ["goodput: no events recorded (events.jsonl is missing or empty)"]
    sessions = len(result.sessions)
    lines = [f"goodput {result.fraction:.0%}: {_duration(result.productive)} of steps in {_duration(result.wall)}"]
    lines[0] += f" over {sessions} session(s)"
    lost = [
        f"{name} {_duration(seconds)}"
        for name, seconds in result.lost.items()
        if seconds >= 0.05 and name != "retrained"
    ]
    lines.append(f"lost: {', '.join(lost) if lost else 'nothing measurable'}")
    if result.retrained_steps:
        lines.append(f"retrained {result.retrained_steps} steps, {_duration(result.lost['retrained'])}")
    for number, session in enumerate(result.sessions[1:], start=2):
        restarted = f", restarted after {session.restart}" if session.restart else ""
        lines.append(
            f"session {number}{restarted}: resumed from step {session.first_step} "
            f"({session.source or 'fresh start'}), reached step {session.reached}"
        )
    return lines


def goodput_report(run_dir: str | Path) -> str:
    """``functrain inspect RUN_DIR --goodput``: the report of a run directory's ``events.jsonl``."""
    return "\n".join(goodput_lines(goodput_of(read_events(run_dir))))
