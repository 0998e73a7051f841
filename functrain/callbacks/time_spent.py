"""Where a session's time goes while it runs: seconds restoring, evaluating and saving, each without the compiling
that happened inside it (compiling is its own bin, from JAX's monitoring events).

The loop measures into the :class:`TimeSpent` on its record; callbacks read the totals through the view
(``view.time_spent``), and :class:`~functrain.report.events.RunEvents` writes them into ``events.jsonl``, from which
:mod:`functrain.report.goodput` tells a run's goodput.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Callable, Iterator

import psutil


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
