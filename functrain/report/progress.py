"""The progress bar: steps, steps/s, ETA and the latest loss on stderr."""

import sys
from typing import Any

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView


class ProgressBar(Callback):
    """A tqdm bar with steps/s, ETA and the latest loss (primary process only)."""

    def __init__(self) -> None:
        self.bar: Any = None  # a tqdm bar, opened when training begins (process 0)

    def on_train_begin(self, view: RunView) -> None:
        if view.is_primary:
            from tqdm import tqdm

            self.bar = tqdm(
                total=view.max_steps,
                initial=view.step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5,
            )

    def on_step_end(self, view: RunView) -> None:
        if self.bar is not None:
            self.bar.update(view.step - self.bar.n)

    def on_log(self, view: RunView, split: str, step: int, metrics: dict[str, float]) -> None:
        if self.bar is not None and "loss" in metrics:
            postfix = {f"{split}_loss": f"{metrics['loss']:.4f}", "epoch": view.epoch}
            if "tokens_per_sec" in metrics:
                postfix["tok/s"] = f"{metrics['tokens_per_sec']:,.0f}"
            if "mfu" in metrics:
                postfix["mfu"] = f"{metrics['mfu']:.1%}"
            self.bar.set_postfix(postfix, refresh=False)

    def on_train_end(self, view: RunView) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def on_exception(self, view: RunView, error: Exception) -> None:
        self.on_train_end(view)  # the bar's line ends: the error is printed on a line of its own
