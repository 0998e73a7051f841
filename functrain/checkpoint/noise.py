"""Keep Orbax's and tensorstore's background tracebacks off the console (the CLI without ``--debug``).

A failed save or read is reported once, as a ``CheckpointError`` line (or a warning with
``checkpoint.on_error=warn``). Meanwhile Orbax's background threads log the same failure with full
tracebacks through absl, asyncio reports the tasks it abandoned, and tensorstore's callbacks into closed
event loops end in "unraisable" exceptions: hundreds of lines burying the one that matters. This drops
those error records and hooks; warnings still pass, and ``--debug`` keeps everything.
"""

from __future__ import annotations

import logging
import sys
import threading

_BACKGROUND_LOGGERS = ("absl", "asyncio")  # Orbax logs through absl


class _DropErrors(logging.Filter):
    """Passes records below ERROR: the failures themselves are surfaced by the code that waited on them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def silence_background_tracebacks() -> None:
    """Drop error records of Orbax's logging and exceptions escaping background threads or callbacks."""
    for name in _BACKGROUND_LOGGERS:
        logging.getLogger(name).addFilter(_DropErrors())
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda failure: None
