"""The summary printed at the end of a run: where it stopped, how much it saw, how good it got, what it left.

``RunSummary`` writes ``RUN_DIR/plot.png`` (``log.plot``) and then logs: steps and stop reason, wall time of
this session, samples and tokens seen, the last and best eval metrics over the run's whole history
(``metrics.jsonl``, resumes included), the goodput of the whole run (``events.jsonl``), the checkpoints kept,
and where the plot and the samples are.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.errors import FunctrainError

log = logging.getLogger("functrain")


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


# Eval metrics the summary reports when a run logs them, and which way is better; the tasks declare more
# (functrain.tasks.task_summary_metrics).
CORE_SUMMARY_METRICS = (("loss", "min"), ("accuracy", "max"))
BEST = {"min": min, "max": max}


def eval_lines(run_dir: Path) -> list[str]:
    """``eval <metric>: last .. at step .., best .. at step ..`` for the :data:`CORE_SUMMARY_METRICS` and the
    tasks' declared ones (a preference run's reward margin and accuracy) a run logs, from metrics.jsonl."""
    from functrain.report.plots import read_run
    from functrain.tasks import task_summary_metrics

    try:
        run = read_run(run_dir)
    except FunctrainError:
        return []
    lines = []
    for metric, better in dict.fromkeys([*CORE_SUMMARY_METRICS, *task_summary_metrics()]):
        series = run.series("eval", metric)
        if series is None:
            continue
        points = [(float(v), int(s)) for s, v in zip(*series) if math.isfinite(v)]
        if not points:
            continue
        best_value, best_step = BEST[better](points, key=lambda p: p[0])
        lines.append(
            f"eval {metric}: last {points[-1][0]:.4g} at step {points[-1][1]}, "
            f"best {best_value:.4g} at step {best_step}"
        )
    return lines


def summary_lines(
    view: RunView, wall_seconds: float, plot_path: Path | None, tokens_per_sample: int | None = None
) -> list[str]:
    """The summary of a finished (or stopped) run, one fact per line (``tokens_per_sample``: a language
    model's sequence length, for the tokens seen)."""
    from functrain.checkpoint import layout
    from functrain.report.events import read_events
    from functrain.report.goodput import goodput_lines, goodput_of
    from functrain.report.samples import SAMPLES_FILE, last_samples

    seen = f"{view.samples_consumed:,} samples"
    tokens = tokens_per_sample
    if tokens:
        seen += f" ({view.samples_consumed * tokens:,} tokens)"
    lines = [
        f"summary of {view.run_dir}:",
        f"  steps {view.start_step} -> {view.step} ({view.stop_reason}) in {_duration(wall_seconds)}; {seen} seen",
    ]
    if view.started_from is not None:
        lines.append(f"  started from the weights of {view.started_from} (train.init_from)")
    lines += [f"  {line}" for line in eval_lines(view.run_dir)]
    goodput = goodput_of(read_events(view.run_dir))
    if goodput.sessions:
        lines += [f"  {line}" for line in goodput_lines(goodput)]
    kept = layout.committed_steps(layout.checkpoints_dir(view.run_dir))
    lines.append(f"  checkpoints kept: {', '.join(map(str, kept)) if kept else 'none'}")
    if plot_path is not None:
        lines.append(f"  plot: {plot_path}")
    samples = last_samples(view.run_dir)
    if samples:
        text = samples[0]["prompt"] + samples[0]["text"]
        lines.append(f"  samples: {view.run_dir / SAMPLES_FILE}; at step {samples[0]['step']}:")
        lines += [f"    | {line}" for line in text.splitlines()[:8]]
    return lines


class RunSummary(Callback):
    """Writes the plot and logs the summary when training ends (primary process only)."""

    def __init__(self, tokens_per_sample: int | None = None, plot: bool = False) -> None:
        """``plot``: write ``RUN_DIR/plot.png`` first (``log.plot``)."""
        self.tokens_per_sample, self.plot = tokens_per_sample, plot
        self.started = time.perf_counter()
        self.plot_path: Path | None = None

    def on_train_begin(self, view: RunView) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, view: RunView) -> None:
        if not view.is_primary:
            return
        if self.plot:
            from functrain.report.plots import plot_runs

            try:
                self.plot_path = plot_runs([view.run_dir], view.run_dir / "plot.png")
            except FunctrainError:  # nothing logged yet: no plot
                self.plot_path = None
            except ImportError:
                log.warning("log.plot needs matplotlib; pip install matplotlib (or set log.plot=false)")
        log.info(
            "\n".join(summary_lines(view, time.perf_counter() - self.started, self.plot_path, self.tokens_per_sample))
        )
