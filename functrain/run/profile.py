"""``profile.start_step`` / ``profile.steps``: a JAX profiler trace of a window of training steps.

The trace starts at the first call boundary at or after ``start_step`` and stops at the first one at or after
``start_step + steps`` (with ``train.steps_per_call`` > 1 the window widens to whole calls), written under
``RUN_DIR/profile/`` (``plugins/profile/<time>/*.xplane.pb``). Open it with TensorBoard's profile plugin
(``pip install tensorboard-plugin-profile; tensorboard --logdir RUN_DIR/profile``) or XProf
(``pip install xprof; xprof --logdir RUN_DIR/profile``).
"""

from __future__ import annotations

import jax

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView


class ProfileWindow(Callback):
    """Traces steps ``[start_step, start_step + steps)`` of the primary process into ``RUN_DIR/profile``."""

    def __init__(self, start_step: int, steps: int) -> None:
        self.start_step, self.stop_step = start_step, start_step + steps
        self.active = False

    def _start(self, view: RunView) -> None:
        jax.profiler.start_trace(str(view.run_dir / "profile"))
        self.active = True

    def _stop(self) -> None:
        jax.effects_barrier()  # the window's dispatched steps finish inside the trace
        jax.profiler.stop_trace()
        self.active = False

    def on_train_begin(self, view: RunView) -> None:
        if view.is_primary and self.start_step <= view.step < self.stop_step:
            self._start(view)

    def on_step_end(self, view: RunView) -> None:
        if not view.is_primary:
            return
        if self.active and view.step >= self.stop_step:
            self._stop()
        elif not self.active and self.start_step <= view.step < self.stop_step:
            self._start(view)

    def on_train_end(self, view: RunView) -> None:
        if self.active:  # the run stopped inside the window (preemption, early stopping)
            self._stop()
