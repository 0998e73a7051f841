"""Where a run's own lines go: the ``functrain`` logger, on stderr, for the command line and ``fit()`` alike.

The loop logs the run directory and the start, warnings and the end summary at INFO on the ``functrain`` logger.
Python prints nothing below WARNING until logging is configured, so ``fit()`` would train in silence where
``functrain train`` says all of it: :func:`show_run_lines` gives the logger a stderr handler of its own, unless the
program configured logging itself (the ``functrain`` logger, or a handler on the root logger other than the bare
one absl's first log call installs): then the lines go where the program says, at the levels it set.
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


def _is_bare_default(handler: logging.Handler) -> bool:
    """Whether ``handler`` is what ``logging.basicConfig()`` installs unasked (absl calls it on its first log
    line, as Orbax's import does): a plain stream handler to stderr with the default format."""
    formatter = handler.formatter
    return (
        type(handler) is logging.StreamHandler
        and handler.stream in (sys.stderr, sys.__stderr__)
        and (formatter is None or formatter._fmt == logging.BASIC_FORMAT)
    )


def show_run_lines() -> None:
    """Print the run's INFO lines on stderr as the command line does, unless the program configured logging
    itself (see the module)."""
    run_log = logging.getLogger(RUN_LOGGER)
    if run_log.handlers or run_log.level != logging.NOTSET:
        return
    if not all(_is_bare_default(handler) for handler in logging.getLogger().handlers):
        return
    add_stderr_handler(run_log)
