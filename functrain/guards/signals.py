"""Stop signals: SIGTERM/SIGINT as a request to save and stop at the next call boundary inside the loop, and
as a clean exit (status 75, nothing written) before the loop takes over.

Python runs a signal handler only when the main thread runs Python. Before the loop the main thread may sit in
the runtime for minutes (allocating a state, compiling, waiting for a device) and would never see the signal, so
a watcher thread learns of it through the wakeup file descriptor and, when the process has not ended by itself
within ``STUCK_AFTER_S``, ends it with the same line and status, having released what it holds (the run
directory's lock: see :func:`release_on_hard_exit`).
"""

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from functrain.errors import EXIT_SIGNAL

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long the main thread has to act on a stop signal before the loop runs (its handler raises at once when it
# runs Python) before the watcher ends the process for it.
STUCK_AFTER_S = 2.0
# A signal a command took before the loop ran: set by CommandSignals, read by check_interrupted.
_received_outside: list[str] = []
# Set once the loop's StopSignals took over: from then on a signal is a request to save, never a hard exit.
_loop_entered = threading.Event()
# What a hard exit undoes first (a held run lock's release), newest last.
_hard_exit_cleanups: list[Callable[[], None]] = []


def interrupted_message(signal_name: str) -> str:
    """The line a command prints when a stop signal ended it outside the training loop."""
    return (
        f"functrain: {signal_name} received outside the training loop: stopped, the run directory keeps its "
        f"newest whole checkpoint; run the same command again to resume"
    )


_announced = threading.Lock()  # held once the line is printed: the command and the watcher print it once between them


def announce_interrupted(signal_name: str) -> None:
    """Print :func:`interrupted_message` to stderr, unless this process printed it already."""
    if _announced.acquire(blocking=False):
        print(interrupted_message(signal_name), file=sys.stderr)


def release_on_hard_exit(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` if a stop signal ends the process from the watcher thread (see the module)."""
    _hard_exit_cleanups.append(cleanup)


def forget_on_hard_exit(cleanup: Callable[[], None]) -> None:
    """Undo :func:`release_on_hard_exit` (the cleanup ran in the ordinary way)."""
    if cleanup in _hard_exit_cleanups:
        _hard_exit_cleanups.remove(cleanup)


class Interrupted(Exception):
    """A stop signal arrived while the loop was not running (before its first step, or after its last)."""


def interrupted_by() -> str | None:
    """The stop signal this command received outside the training loop (``SIGTERM``), or None."""
    return _received_outside[0] if _received_outside else None


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
        _loop_entered.set()
        return super().__enter__()


class CommandSignals(_Handlers):
    """SIGTERM/SIGINT for a whole ``functrain train`` command, from its first instant: outside the loop (JAX
    importing, a checkpoint restoring, the step compiling) a signal raises :class:`Interrupted`, so the
    command exits with the planned status instead of dying by the signal, and a main thread held in the runtime
    is ended from the watcher thread (see the module); inside, the loop's own :class:`StopSignals` saves and
    stops at the next call boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeup: tuple[int, int] | None = None  # (read, write) ends of the wakeup pipe; the watcher reads
        self.previous_wakeup = -1

    def handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        _received_outside.append(name)
        raise Interrupted(name)

    def __enter__(self) -> "CommandSignals":
        super().__enter__()
        _loop_entered.clear()
        if self.previous:  # the main thread: the only one that may set the wakeup descriptor
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)
            self.previous_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
            self.wakeup = (read_end, write_end)
            threading.Thread(target=self._watch, args=(read_end,), name="functrain-stop-watch", daemon=True).start()
        return self

    def _watch(self, read_end: int) -> None:
        """Wait for stop signals (their numbers, written by the interpreter's C handler) until the pipe closes."""
        try:
            while received := os.read(read_end, 64):
                for signum in received:
                    ours = signal.getsignal(signum) == self.handle  # not the loop's, nor a launcher's
                    if signum in STOP_SIGNALS and ours and not _loop_entered.is_set():
                        self._end_unless_ended(signal.Signals(signum).name)
        finally:
            os.close(read_end)

    def _end_unless_ended(self, signal_name: str) -> None:
        time.sleep(STUCK_AFTER_S)  # a main thread that runs Python raises Interrupted and the process ends
        if _loop_entered.is_set():
            return
        for cleanup in reversed(_hard_exit_cleanups):
            try:
                cleanup()
            except Exception:  # noqa: BLE001 -- the process ends either way; release what else it holds
                pass
        # Whether or not the handler ran: its Interrupted may have been raised where Python swallows exceptions
        # (a garbage-collection callback: "Exception ignored in ..."), so the command may have printed nothing.
        announce_interrupted(signal_name)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_SIGNAL)

    def __exit__(self, *exc_info: Any) -> None:
        super().__exit__(*exc_info)
        if self.wakeup is not None:
            signal.set_wakeup_fd(self.previous_wakeup)
            os.close(self.wakeup[1])  # the watcher's read sees the end of the pipe, closes its end and returns
            self.wakeup = None
        _received_outside.clear()
        if _announced.locked():  # the next command in this process announces its own stop
            _announced.release()
