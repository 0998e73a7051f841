"""SIGTERM/SIGINT as a request to save and stop at the next call boundary."""

import signal
import threading
from typing import Any


class StopSignals:
    """Turns SIGTERM/SIGINT into a request to save and stop at the next call boundary.

    A second SIGINT interrupts at once (the usual escape hatch when a step hangs).
    """

    def __init__(self) -> None:
        self.received: str | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class Interrupted(Exception):
    """A stop signal arrived while the loop was not running (before its first step, or after its last)."""


class CommandSignals:
    """SIGTERM/SIGINT for a whole ``functrain train`` command, from its first instant: outside the loop (JAX
    importing, a checkpoint restoring, the step compiling) a signal raises :class:`Interrupted`, so the
    command exits with the planned status instead of dying by the signal; inside, the loop's own
    :class:`StopSignals` saves and stops at the next call boundary."""

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    @staticmethod
    def _handle(signum: int, frame: Any) -> None:
        raise Interrupted(signal.Signals(signum).name)

    def __enter__(self) -> "CommandSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
