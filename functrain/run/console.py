"""Where a run's own lines go: the ``functrain`` logger, on stderr, for the command line and ``fit()`` alike.

The loop logs the run directory and the start, warnings and the end summary at INFO on the ``functrain`` logger.
Python prints nothing below WARNING until a handler is configured, so without one ``fit()`` would train in silence
where ``functrain train`` says all of it: :func:`show_run_lines` gives the logger a stderr handler, unless the
program configured that logger itself (a handler or a level of its own: then its lines go where it says).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

RUN_LOGGER = "functrain"


class StderrHandler(logging.StreamHandler):
    """Writes each line to ``sys.stderr`` as it is when the line is logged, never to the stream that was
    ``sys.stderr`` when the handler was made: that one may be closed since (a test's captured stream, a redirect,
    a notebook cell's)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:  # StreamHandler.__init__ sets one; this handler has none of its own
        pass


def add_stderr_handler(run_log: logging.Logger) -> None:
    """The run's lines on stderr, printed once (not again by the root logger's handlers: absl installs one)."""
    if not any(isinstance(handler, StderrHandler) for handler in run_log.handlers):  # once per process
        run_log.addHandler(StderrHandler())
    run_log.propagate = False
    run_log.setLevel(logging.INFO)


def show_run_lines() -> None:
    """Print the run's INFO lines on stderr as the command line does, unless the program configured the
    ``functrain`` logger (a handler or a level) itself."""
    run_log = logging.getLogger(RUN_LOGGER)
    if run_log.handlers or run_log.level != logging.NOTSET:
        return
    add_stderr_handler(run_log)
