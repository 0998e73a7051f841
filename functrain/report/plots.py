"""``functrain plot RUN_DIR [RUN_DIR ...] [-o FILE.png]``: the curves of one or several runs in one PNG.

Panels against step: train and eval loss (log scale when it spans more than a decade), learning rate,
gradient norm, throughput (tokens/s, else samples/s, else steps/s), and MFU, accuracy, the panels the tasks declare
(:class:`functrain.tasks.declaration.Panel`: a preference run's reward margin and accuracy, a GRPO run's mean reward
and KL) and a mixture of experts' router losses and dropped fraction (``moe/aux_loss``, ``moe/z_loss``,
``moe/dropped_fraction``) when a run logs them, and one
panel per lm-eval score (``harness/<task>/<metric>``, see ``eval.harness_tasks``). Each run has one colour; a
smoothed line (TensorBoard's debiased moving average) is drawn over the faint raw values. Steps whose update
was skipped for a non-finite loss or gradient are red crosses; resumes (from ``events.jsonl``) are dotted
vertical lines. matplotlib renders headless (Agg).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from functrain.errors import DataError, FunctrainError
from functrain.report.events import read_events

SMOOTHING = 0.6  # weight of the past in the moving average (TensorBoard's default)
# (panel title, y label, train metric, whether eval values are drawn too, whether it is noisy: smoothed);
# throughput is the first of tokens/s, samples/s, steps/s that a run logs.
CORE_PANELS = [
    ("loss", "mean loss", "loss", True, True),
    ("learning rate", "learning rate", "learning_rate", False, False),
    ("gradient norm", "global grad norm", "grad_norm", False, True),
    ("throughput", None, ("tokens_per_sec", "samples_per_sec", "steps_per_sec"), False, True),
    ("MFU", "model FLOPs utilisation", "mfu", False, True),
    ("accuracy", "accuracy", "accuracy", True, True),
]
# A mixture of experts' router terms (every task adds them: functrain.core.program.task_program).
MOE_PANELS = [
    ("router balancing loss", "moe/aux_loss", "moe/aux_loss", True, True),
    ("router z-loss", "moe/z_loss", "moe/z_loss", True, True),
    ("dropped selections", "moe/dropped_fraction", "moe/dropped_fraction", True, True),
]
# The first four panels; MFU, accuracy, the tasks' panels and a mixture of experts' router losses only when some run
# logs them.
ALWAYS_SHOWN = 4


def panels() -> list[tuple]:
    """Every panel: the core ones, those the tasks declare (:func:`functrain.tasks.task_panels`), the router's."""
    from functrain.tasks import task_panels

    declared = [(p.title, p.label, p.metric, p.with_eval, p.smoothed) for p in task_panels()]
    return [*CORE_PANELS, *declared, *MOE_PANELS]


HARNESS = "harness"  # the split of lm-eval scores: a panel each
PANEL_INCHES = (5.2, 3.6)  # width, height of one panel's share of the figure


@dataclass
class RunCurves:
    """The logged metrics of one run: ``split -> metric -> (steps, values)`` plus its marks."""

    name: str
    curves: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    nonfinite_steps: list[int] = field(default_factory=list)
    resume_steps: list[int] = field(default_factory=list)

    def series(self, split: str, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(steps, values)`` of a metric (NaN where a non-finite value was logged), or None."""
        return self.curves.get(split, {}).get(metric)


def _numeric(value: Any) -> float | None:
    if value is None:  # NaN/inf are written as null
        return float("nan")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def read_run(run_dir: str | os.PathLike, name: str | None = None) -> RunCurves:
    """The curves of ``RUN_DIR/metrics.jsonl``; a missing or empty file is a :class:`DataError`."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise DataError(
            f"{run_dir} has no metrics.jsonl; pass the run.dir of a training run that has logged (train it first)"
        )
    points: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            step, split = int(record["step"]), str(record["split"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
        for metric, value in record.items():
            number = _numeric(value)
            if metric not in ("step", "split") and number is not None:
                points.setdefault(split, {}).setdefault(metric, []).append((step, number))
    if not points:
        raise DataError(f"{path} holds no metrics yet; plot after the run has logged (log.every_steps)")
    run = RunCurves(name or run_dir.name)
    for split, metrics in points.items():
        for metric, pairs in metrics.items():
            steps, values = (np.array(column) for column in zip(*sorted(dict(pairs).items())))
            run.curves.setdefault(split, {})[metric] = (steps, values)
    run.nonfinite_steps = _nonfinite_steps(run)
    run.resume_steps = [int(e["step"]) for e in read_events(run_dir) if e["event"] in ("resume", "rewind")]
    return run


def _nonfinite_steps(run: RunCurves) -> list[int]:
    """Log steps at which the cumulative count of skipped non-finite steps rose, or the loss was not finite."""
    marked: set[int] = set()
    counts = run.series("train", "nonfinite_steps")
    if counts is not None:
        steps, values = counts
        previous = np.concatenate([[0.0], values[:-1]])
        marked.update(int(s) for s in steps[values > previous])
    loss = run.series("train", "loss")
    if loss is not None:
        marked.update(int(s) for s in loss[0][~np.isfinite(loss[1])])
    return sorted(marked)


def smooth(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's smoothing); non-finite values are passed over."""
    out = np.empty_like(values, dtype=np.float64)
    average, total_weight = 0.0, 0.0
    for i, value in enumerate(values):
        if np.isfinite(value):
            average = weight * average + (1 - weight) * value
            total_weight = weight * total_weight + (1 - weight)
        out[i] = average / total_weight if total_weight else np.nan
    return out


def _wants_log_scale(values: list[np.ndarray]) -> bool:
    finite = np.concatenate([v[np.isfinite(v)] for v in values]) if values else np.array([])
    return bool(len(finite)) and finite.min() > 0 and finite.max() / finite.min() > 10


def _draw_panel(
    ax: Any, runs: list[RunCurves], colours: list[Any], metric: str, with_eval: bool, noisy: bool, split: str = "train"
) -> None:
    drawn = []
    for run, colour in zip(runs, colours):
        train = run.series(split, metric)
        if train is not None:
            steps, values = train
            drawn.append(values)
            if noisy and len(values) > 3:
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=0.8)
                ax.plot(steps, smooth(values), color=colour, linewidth=1.6, label=f"{run.name} {split}")
            else:
                ax.plot(
                    steps, values, color=colour, marker="." if len(values) <= 3 else None, label=f"{run.name} {split}"
                )
        evaluated = run.series("eval", metric) if with_eval else None
        if evaluated is not None:
            drawn.append(evaluated[1])
            ax.plot(*evaluated, color=colour, linestyle="--", marker="o", markersize=3, label=f"{run.name} eval")
        for step in run.resume_steps:
            ax.axvline(step, color=colour, linestyle=":", linewidth=1.0, alpha=0.8)
        if run.nonfinite_steps and train is not None and split == "train":
            finite = train[1][np.isfinite(train[1])]
            floor = float(finite.min()) if len(finite) else 0.0
            ax.plot(
                run.nonfinite_steps,
                [floor] * len(run.nonfinite_steps),
                linestyle="none",
                marker="x",
                color="red",
                markersize=7,
                label=f"{run.name} skipped (non-finite)",
            )
    if (metric == "loss" or "perplexity" in metric) and _wants_log_scale(drawn):
        ax.set_yscale("log")
    if not drawn:
        ax.text(0.5, 0.5, "not logged", transform=ax.transAxes, ha="center", va="center", color="grey")


def _resolve(panel: tuple, runs: list[RunCurves]) -> tuple:
    """A panel with one metric: the first alternative any run logs (the last when none does)."""
    title, ylabel, metric, with_eval, noisy = panel
    if isinstance(metric, str):
        return panel
    chosen = next((m for m in metric if any(run.series("train", m) is not None for run in runs)), metric[-1])
    return title, ylabel or chosen.removesuffix("_per_sec").replace("_", " ") + " / s", chosen, with_eval, noisy


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write the PNG of the runs' curves to ``out`` (a directory: ``plot.png`` in it) and return its path. Runs
    are read before anything is written and a failed write removes its temporary file, so an error leaves no
    file behind."""
    # A figure of its own on Agg's canvas, not pyplot's: nothing global (a notebook's backend) changes, and pyplot's
    # import (a quarter of a second) is skipped at the end of every run.
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    out = Path(out)
    if out.is_dir():  # `-o DIR`: the PNG goes inside it, as `cp FILE DIR` puts a file there
        out = out / "plot.png"
    names = [Path(d).name for d in run_dirs]
    if len(set(names)) < len(names):  # same leaf name: tell them apart by their full paths
        names = [str(d) for d in run_dirs]
    runs = [read_run(d, n) for d, n in zip(run_dirs, names)]
    resolved = [_resolve(panel, runs) for panel in panels()]
    shown = resolved[:ALWAYS_SHOWN] + [
        p for p in resolved[ALWAYS_SHOWN:] if any(run.series("train", p[2]) is not None for run in runs)
    ]
    scores = sorted({name for run in runs for name in run.curves.get(HARNESS, {})})
    drawn = [(*panel, "train") for panel in shown] + [
        (f"lm-eval {name}", name.rpartition("/")[2], name, False, False, HARNESS) for name in scores
    ]
    columns = 3
    rows = -(-len(drawn) // columns)
    colours = [matplotlib.colormaps["tab10"](i % 10) for i in range(len(runs))]
    fig = Figure(figsize=(PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, (title, ylabel, metric, with_eval, noisy, split) in zip(axes.flat, drawn):
        _draw_panel(ax, runs, colours, metric, with_eval, noisy, split)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if any(run.resume_steps for run in runs):
        handles.append(Line2D([], [], color="grey", linestyle=":"))
        labels.append("resume")
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize="small", frameon=False)
    fig.subplots_adjust(**margins(rows, columns, legend_rows=-(-len(labels) // 4)))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.png")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=100)
        tmp.replace(out)
    except OSError as exc:
        with contextlib.suppress(OSError):  # never created where the directory could not be
            tmp.unlink(missing_ok=True)
        where = f": {exc.filename}" if exc.filename else ""
        raise FunctrainError(
            f"cannot write the plot to {out} ({exc.strerror or exc}{where}); choose another -o path"
        ) from None
    return out


def margins(rows: int, columns: int, legend_rows: int) -> dict[str, float]:
    """``subplots_adjust``'s fractions for a grid of ``PANEL_INCHES`` panels with fixed margins in inches (room for
    the tick labels, axis labels and titles, the legend's rows below): a fixed layout costs nothing to compute,
    where ``tight_layout`` drew every text once more to measure it (40% of a plot's time)."""
    width, height = PANEL_INCHES[0] * columns, PANEL_INCHES[1] * rows
    left, right, top, gap_x, gap_y = 1.1, 0.25, 0.4, 1.2, 0.85
    bottom = 0.6 + 0.25 * legend_rows
    panel_width = (width - left - right - gap_x * (columns - 1)) / columns
    panel_height = (height - top - bottom - gap_y * (rows - 1)) / rows
    return dict(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                wspace=gap_x / panel_width, hspace=gap_y / panel_height)  # fmt: skip


def default_output(run_dirs: list[str | os.PathLike]) -> Path:
    """``RUN_DIR/plot.png`` for one run, ``./plot.png`` for several."""
    return Path(run_dirs[0]) / "plot.png" if len(run_dirs) == 1 else Path("plot.png")
