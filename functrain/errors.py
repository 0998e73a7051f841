"""Errors for bad input: each carries one line that names the problem and the fix.

The CLI prints that line and exits with status 2 (no traceback unless ``--debug``). User code that fails during a
run (a reward function, a ``loss_fn``, a transform, a callback) is a :class:`UserCodeError`, named with its file and
line (:func:`user_code_site`, :func:`definition_site`).
The exit statuses of ``functrain train`` live here too (see :mod:`functrain.callbacks.outcome` for what each means):
the launcher of a multi-process job needs them, below everything that runs a job.
"""

import os
import sysconfig
from pathlib import Path
from types import TracebackType
from typing import Any

EXIT_FINISHED = 0
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_MOSTLY_SKIPPED = 4
EXIT_SIGNAL = 75
# Statuses with which a process of a multi-process job ends on purpose (every process agrees on them):
# the launcher does not take them for a crash that should stop the other processes.
PLANNED_EXITS = (EXIT_FINISHED, EXIT_NONFINITE, EXIT_MOSTLY_SKIPPED, EXIT_SIGNAL)


# How to install PyTorch, in the errors that need it: the script picks the CPU build where no GPU is present (a plain
# `pip install torch` pulls several GB of CUDA packages onto a machine that cannot use them).
TORCH_INSTALL = (
    "install it with `sh tools/install_torch.sh PYTHON` from a checkout (the CPU build where no GPU is present), "
    "or pip install 'functrain[torch]'"
)


class FunctrainError(Exception):
    """Bad input from the user: a config, data, checkpoint or directory problem."""


class ConfigError(FunctrainError):
    """A config file or override is malformed, unknown or of the wrong type."""


class DataError(FunctrainError):
    """A data source is missing, empty or does not fit the requested batching."""


class CheckpointError(FunctrainError):
    """A checkpoint is missing, damaged or incompatible with the current run."""


class UserCodeError(FunctrainError):
    """User code failed during a run: ``what`` names the function, where it is and what it did (``the reward
    function f (rewards.py:12) raised ValueError: ...``); ``step``, 1-based, is the step it failed at when the code
    that called it knows (the loop adds the step otherwise, the checkpoint to resume from, and the fix)."""

    def __init__(self, what: str, step: int | None = None) -> None:
        super().__init__(what)
        self.what, self.step = what, step


# Code that is not the user's: this package and torch_bridge (beside it in a checkout), the standard library and
# installed packages (JAX, numpy, ...).
_LIBRARY_ROOTS = tuple(
    {str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent / "torch_bridge")}
    | {str(Path(sysconfig.get_paths()[name]).resolve()) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def _shown(file: str) -> str:
    """``file`` relative to the working directory when it is inside it (as the user wrote it), else as it is."""
    try:
        relative = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        return file
    return file if relative.startswith(os.pardir) else relative


def _is_users(file: str) -> bool:
    if file.startswith("<frozen"):
        return False
    resolved = file if file.startswith("<") else str(Path(file).resolve())
    return not any(resolved == root or resolved.startswith(root + os.sep) for root in _LIBRARY_ROOTS)


def user_code_site(error: BaseException) -> tuple[str, str] | None:
    """``(function, "file:line")`` of the innermost frame of ``error``'s traceback in the user's code (outside
    functrain, the standard library and installed packages): where it failed; None when no frame is the user's."""
    traceback: TracebackType | None = error.__traceback__
    found = None
    while traceback is not None:
        code = traceback.tb_frame.f_code
        if _is_users(code.co_filename):
            name = getattr(code, "co_qualname", code.co_name)  # Python 3.11+: Class.method
            found = (name, f"{_shown(code.co_filename)}:{traceback.tb_lineno}")
        traceback = traceback.tb_next
    return found


_FAILURE = "functrain_failure"


def mark_user_code_failure(error: BaseException, line: str) -> None:
    """Attach ``line``, the one-line report of user code's ``error`` during a run, to ``error`` (raised on as it is,
    so code that catches its own exception types still does); the CLI prints it and exits 2, Python shows it as
    the exception's note."""
    setattr(error, _FAILURE, line)
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"functrain: {line}")


def user_code_failure(error: BaseException) -> str | None:
    """The one-line report :func:`mark_user_code_failure` attached to ``error``, or None."""
    return getattr(error, _FAILURE, None)


def definition_site(function: Any) -> str | None:
    """``file:line`` where ``function`` is defined, or None for a callable without Python source (a builtin)."""
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    return None if code is None else f"{_shown(code.co_filename)}:{code.co_firstlineno}"


def one_line(error: BaseException) -> str:
    """``ValueError: the message`` with its whitespace (newlines too) folded to single spaces."""
    return " ".join(f"{type(error).__name__}: {error}".split())
