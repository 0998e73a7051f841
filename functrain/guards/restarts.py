"""``functrain train CONFIG --restarts N``: rerun a run that died, resuming from its newest checkpoint each time.

The supervisor starts the same command (without ``--restarts``) as a child process and waits. A run that died
(a crash, a kill, a lost process of a ``--processes`` job, a stop signal that did not come through the
supervisor) is started again after a pause that doubles from ``--restart-delay`` up to :data:`MAX_DELAY_S`, at
most N times; each start resumes where the checkpoints stand. A ``--processes`` job is one child: all its
processes end and start together. Never started again:

* a finished run (exit 0, or 4: finished with most steps skipped), and a rerun of one, which exits 0 too;
* bad input (exit 2): the same command fails the same way;
* a non-finite stop (exit 3, ``train.nonfinite: stop``): the same data reaches the same step, so it would stop
  there again; ``functrain rewind`` moves the run back first;
* a stop signal sent to the supervisor itself: it is passed on to the run (which saves and exits 75) and the
  supervisor exits with the run's status; the job is being stopped, not preempted from below.

No JAX here: the supervisor stays small and takes signals from its first instant.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from functrain.errors import EXIT_BAD_INPUT, EXIT_FINISHED, EXIT_MOSTLY_SKIPPED, EXIT_NONFINITE

MAX_DELAY_S = 300.0
# Environment of a restarted attempt: which restart it is and how the previous attempt ended (events.jsonl).
ENV_RESTART = "FUNCTRAIN_RESTART"
ENV_PREVIOUS_EXIT = "FUNCTRAIN_PREVIOUS_EXIT"
_FINAL = {
    EXIT_FINISHED: "finished",
    EXIT_MOSTLY_SKIPPED: "finished",
    EXIT_BAD_INPUT: "bad input: the same command would fail the same way",
    EXIT_NONFINITE: "a non-finite step stopped it: a rerun would stop at the same step",
}


def describe_exit(code: int) -> str:
    """``status 75`` / ``SIGKILL`` for a child's return code (a ``--processes`` launcher reports a process killed
    by signal ``s`` as 128+s)."""
    signum = -code if code < 0 else code - 128 if code > 128 else None
    if signum is None:
        return f"status {code}"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"status {code}"


def run_with_restarts(argv: list[str], restarts: int, first_delay_s: float) -> int:
    """Run ``python -m functrain ARGV`` and start it again when it dies, at most ``restarts`` times; returns the
    exit status of the last attempt (a signal ``s`` as 128+s)."""
    command = [sys.executable, "-m", "functrain", *argv]
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        delay, env, code = first_delay_s, dict(os.environ), EXIT_FINISHED
        for attempt in range(restarts + 1):
            child = subprocess.Popen(command, env=env)
            code = child.wait()
            final = _FINAL.get(code)
            if received or final or attempt == restarts:
                if not received and not final:
                    print(f"functrain: the run ended with {describe_exit(code)}; no restarts left", file=sys.stderr)
                break
            print(
                f"functrain: the run ended with {describe_exit(code)}; restarting in {delay:g}s "
                f"(restart {attempt + 1} of {restarts})",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
            if received:  # stopped while waiting: nothing runs, nothing to pass on
                break
            env = {**os.environ, ENV_RESTART: str(attempt + 1), ENV_PREVIOUS_EXIT: describe_exit(code)}
            delay = min(delay * 2, MAX_DELAY_S)
        return code if code >= 0 else 128 - code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
