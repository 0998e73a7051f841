"""Keep Orbax's and tensorstore's background tracebacks off the console (the CLI without ``--debug``).

A failed save or read is reported once, as a ``CheckpointError`` line (or a warning with
``checkpoint.on_error=warn``). Meanwhile Orbax's background threads log the same failure with full
tracebacks through absl, asyncio reports the tasks it abandoned, tensorstore's callbacks into closed
event loops end in "unraisable" exceptions, and the coroutines a failed save left behind warn, as they are
collected at exit, that they were never awaited: hundreds of lines burying the one that matters. This
drops those error records, exceptions and warnings; exceptions raised elsewhere still show, and ``--debug``
keeps everything.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from traceback import walk_tb
from types import TracebackType
from typing import Any, Callable

_BACKGROUND_LOGGERS = ("absl", "asyncio")  # Orbax logs through absl
_BACKGROUND_PACKAGES = tuple(f"{os.sep}{name}{os.sep}" for name in ("orbax", "tensorstore", "asyncio"))


class _DropErrors(logging.Filter):
    """Passes records below ERROR: the failures themselves are surfaced by the code that waited on them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.ERROR


def _raised_in_checkpoint_io(traceback: TracebackType | None) -> bool:
    """Whether a traceback passes through Orbax, tensorstore or asyncio (anything else is still shown)."""
    return any(
        any(part in frame.f_code.co_filename for part in _BACKGROUND_PACKAGES) for frame, _ in walk_tb(traceback)
    )


def _silencing(show: Callable[[Any], object]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook`` / ``threading.excepthook`` that passes on to ``show`` what checkpoint I/O did not
    raise."""

    def hook(report: Any) -> None:
        if not _raised_in_checkpoint_io(report.exc_traceback):
            show(report)

    hook.silences_checkpoint_io = True  # type: ignore[attr-defined]
    return hook


def silence_background_tracebacks() -> None:
    """Drop error records of Orbax's logging, and exceptions that escape Orbax's threads or callbacks. Once: a
    second call in the same process adds nothing."""
    for name in _BACKGROUND_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropErrors) for existing in logger.filters):
            logger.addFilter(_DropErrors())
    if not getattr(sys.unraisablehook, "silences_checkpoint_io", False):
        sys.unraisablehook = _silencing(sys.unraisablehook)
    if not getattr(threading.excepthook, "silences_checkpoint_io", False):
        threading.excepthook = _silencing(threading.excepthook)
    # The warning names the coroutine only (no module to filter on); the CLI runs no coroutines of its own.
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
