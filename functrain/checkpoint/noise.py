"""Keep Orbax's and tensorstore's background tracebacks off the console (the CLI without ``--debug``).

A failed save or read is reported once, as a ``CheckpointError`` line (or a warning with
``checkpoint.on_error=warn``). Meanwhile Orbax's background threads log the same failure with full
tracebacks through absl, asyncio reports the tasks it abandoned, and tensorstore's callbacks into closed
event loops end in "unraisable" exceptions: hundreds of lines burying the one that matters. This drops
those error records and exceptions; warnings and exceptions raised elsewhere still show, and ``--debug``
keeps everything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from traceback import walk_tb
from types import TracebackType
from typing import Any

_BACKGROUND_LOGGERS = ("absl", "asyncio")  # Orbax logs through absl
_BACKGROUND_PACKAGES = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "tensorstore", "asyncio"))


class _DropErrors(logging.Filter):
    """Passes records below ERROR: the failures themselves are surfaced by the code that waited on them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _raised_in_checkpoint_io(traceback: TracebackType | None) -> bool:
    """Whether a traceback passes through Orbax, tensorstore or asyncio (anything else is still shown)."""
    return any(any(part in frame.f_code.co_filename for part in _BACKGROUND_PACKAGES)
               for frame, _ in walk_tb(traceback))


def silence_background_tracebacks() -> None:
    """Drop error records of Orbax's logging, and exceptions that escape Orbax's threads or callbacks."""
    for name in _BACKGROUND_LOGGERS:
        logging.getLogger(name).addFilter(_DropErrors())
    show_unraisable, show_thread_failure = sys.unraisablehook, threading.excepthook

    def unraisable_hook(unraisable: Any) -> None:
        if not _raised_in_checkpoint_io(unraisable.exc_traceback):
            show_unraisable(unraisable)

    def thread_hook(failure: Any) -> None:
        if not _raised_in_checkpoint_io(failure.exc_traceback):
            show_thread_failure(failure)

    sys.unraisablehook, threading.excepthook = unraisable_hook, thread_hook
