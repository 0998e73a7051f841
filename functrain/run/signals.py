"""Stop signals: SIGTERM/SIGINT as a request to save and stop at the next call boundary inside the loop, and
as a clean exit (status 75, nothing written) before the loop takes over."""

import signal
import threading
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A signal a command took before the loop ran: set by CommandSignals, read by check_interrupted.
_received_outside: list[str] = []


class Interrupted(Exception):
    """A stop signal arrived while the loop was not running (before its first step, or after its last)."""


def check_interrupted() -> None:
    """Raise :class:`Interrupted` when a stop signal came before the loop took over. The handler raises it at
    once too, but code that swallows exceptions (a garbage-collection callback, a ``__del__``) can eat that
    one: the loop asks again before it writes anything."""
    if _received_outside:
        raise Interrupted(_received_outside[0])


class _Handlers:
    """Installs the subclass's ``handle`` for SIGTERM/SIGINT while entered (main thread only) and restores what
    was there."""

    handle: Callable[[int, Any], None]  # the subclass's handler: (signal number, frame)

    def __init__(self) -> None:
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Any:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self.handle)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)


class StopSignals(_Handlers):
    """Inside the loop: SIGTERM/SIGINT request a save and a stop at the next call boundary. A second SIGINT
    interrupts at once (the usual escape hatch when a step hangs)."""

    def __init__(self) -> None:
        super().__init__()
        self.received: str | None = None

    def handle(self, signum: int, frame: Any) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name

    def __enter__(self) -> "StopSignals":
        check_interrupted()
        return super().__enter__()


class CommandSignals(_Handlers):
    """SIGTERM/SIGINT for a whole ``functrain train`` command, from its first instant: outside the loop (JAX
    importing, a checkpoint restoring, the step compiling) a signal raises :class:`Interrupted`, so the
    command exits with the planned status instead of dying by the signal; inside, the loop's own
    :class:`StopSignals` saves and stops at the next call boundary."""

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        _received_outside.append(name)
        raise Interrupted(name)

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        _received_outside.clear()
