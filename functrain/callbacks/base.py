"""Callbacks: the loop's events (as users know them from the HF Trainer), the requests they return, and their
dispatch. The built-in callbacks live with their jobs: :mod:`functrain.callbacks.controls` (periodic evaluation
and saving, early stopping) and :mod:`functrain.report` (metrics.jsonl, the progress bar, events, the summary).

Every event gets a read-only :class:`~functrain.callbacks.view.RunView` (where the run stands) and may return a
:class:`Control` asking the loop to stop (with its reason), save or evaluate at the current call boundary, or,
from ``on_evaluate``, to log metrics the callback measured. Events fire at call boundaries: with
``train.steps_per_call = K``, ``on_step_end`` fires once per K steps with ``view.step`` the step reached. When
the run fails once training began, ``on_exception`` fires before the error is raised (the progress bar ends its
line there).
"""

import contextlib
from dataclasses import dataclass
from typing import Any

from functrain.callbacks.outcome import StopKind
from functrain.callbacks.view import RunView
from functrain.errors import ConfigError


@dataclass(slots=True)
class Control:
    """What a callback asks of the loop at the current call boundary.

    With ``should_stop``, ``stop_reason`` is the sentence the run's result carries (``FitResult.stop_reason``)
    and ``stop_kind`` how it ended (``FitResult.stop_kind``; it decides the exit status). ``metrics``, from
    ``on_evaluate`` only: ``{split: {name: value}}`` the callback measured under a split of its own
    (``harness``), which the loop logs (``on_log``) after the evaluation's.
    """

    should_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    stop_reason: str = "stopped by a callback"
    stop_kind: StopKind = StopKind.CALLBACK
    metrics: dict[str, dict[str, float]] | None = None

    def merge(self, other: "Control | None") -> "Control":
        """Any request from either side stands; of two stops, the first, unless the other has an exit status of
        its own (a signal, a non-finite step) and the first has not."""
        if other is None or not (other.should_stop or other.should_save or other.should_evaluate or other.metrics):
            return self  # the common case at a call boundary: nothing asked
        stop = (
            other
            if other.should_stop
            and (not self.should_stop or (other.stop_kind.sets_exit_status and not self.stop_kind.sets_exit_status))
            else self
        )
        return Control(
            self.should_stop or other.should_stop,
            self.should_save or other.should_save,
            self.should_evaluate or other.should_evaluate,
            stop.stop_reason,
            stop.stop_kind,
            _merged_metrics(self.metrics, other.metrics),
        )


def _merged_metrics(
    first: dict[str, dict[str, float]] | None, second: dict[str, dict[str, float]] | None
) -> dict[str, dict[str, float]] | None:
    if not first or not second:
        return first or second
    return {split: {**first.get(split, {}), **second.get(split, {})} for split in {**first, **second}}


class Callback:
    """Base class: override the events you need. Returning None means 'no request'."""

    def on_train_begin(self, view: RunView) -> Control | None: ...
    def on_train_end(self, view: RunView) -> Control | None: ...
    def on_epoch_begin(self, view: RunView) -> Control | None: ...
    def on_epoch_end(self, view: RunView) -> Control | None: ...
    def on_step_end(self, view: RunView) -> Control | None: ...
    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> Control | None: ...
    def on_evaluate(self, view: RunView, metrics: dict[str, float]) -> Control | None: ...
    def on_save(self, view: RunView, step: int) -> Control | None: ...
    def on_exception(self, view: RunView, error: Exception) -> None:
        """The run is failing with ``error`` (raised once this returns): close what the callback keeps open."""


class CallbackList:
    """Dispatches an event to every callback and merges their controls."""

    def __init__(self, callbacks: list[Callback]) -> None:
        self.callbacks = list(callbacks)

    def fire(self, event: str, view: RunView, *args: Any) -> Control:
        control = Control()
        for callback in self.callbacks:
            request = getattr(callback, event)(view, *args)
            if request is not None and request.metrics and event != "on_evaluate":
                raise ConfigError(
                    f"{type(callback).__name__}.{event} returned Control(metrics=...): a callback "
                    f"logs metrics of its own from on_evaluate only"
                )
            control = control.merge(request)
        return control

    def fire_exception(self, view: RunView, error: Exception) -> None:
        """``on_exception`` of every callback that has one; a callback that fails there is passed over, so that
        ``error``, the run's failure, is what the user sees."""
        for callback in self.callbacks:
            with contextlib.suppress(Exception):
                callback.on_exception(view, error)
