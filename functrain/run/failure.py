"""A run that fails after its start, reported as a start-up error is: user code (a reward function, a ``loss_fn``, a
transform, a callback) that raises or returns what it must not is reported in one line (``functrain train`` prints
it and exits 2) with the step it failed at (1-based, as metrics.jsonl counts), the function with its file and line,
the checkpoint the run resumes from once the code is fixed, and what to do. The user's own exception is raised on
as it is, the line attached (:func:`functrain.errors.user_code_failure`); a
:class:`~functrain.errors.UserCodeError` (a reward function's bad value) becomes one with that line. Other failures
(functrain's own errors, a library's) are raised as they are.
"""

from __future__ import annotations

from functrain.errors import FunctrainError, UserCodeError, mark_user_code_failure, one_line, user_code_site


def checkpoint_state(saved_steps: list[int]) -> str:
    """Where running the same command again starts: the newest checkpoint on disk, or the beginning."""
    if not saved_steps:
        return "no checkpoint yet: fix it and run the same command again (the run starts over)"
    return (
        f"the last checkpoint, step {saved_steps[-1]}, is whole: fix it and run the same command again to resume "
        f"from there"
    )


def failure_line(error: Exception, step: int, saved_steps: list[int]) -> str | None:
    """The one-line report of ``error`` raised while the run worked on ``step`` (1-based; a
    :class:`~functrain.errors.UserCodeError` that knows its step keeps it) with checkpoints of ``saved_steps`` on
    disk (oldest first); None when ``error`` is not the user's code's."""
    if isinstance(error, UserCodeError):
        what, step = error.what, error.step or step
    elif isinstance(error, FunctrainError):
        return None
    else:
        site = user_code_site(error)
        if site is None:
            return None
        function, place = site
        what = f"your function {function} ({place}) raised {one_line(error)}"
    return f"at step {step}, {what}; {checkpoint_state(saved_steps)}"


def reported(error: Exception, step: int, saved_steps: list[int]) -> Exception:
    """What to raise for ``error`` (see :func:`failure_line`): a UserCodeError with the whole line in place of a
    UserCodeError; otherwise ``error`` itself, the line attached when it is the user's code's."""
    line = failure_line(error, step, saved_steps)
    if line is None:
        return error
    if isinstance(error, UserCodeError):
        return UserCodeError(line, error.step)
    mark_user_code_failure(error, line)
    return error
