"""Read-only views of a run's checkpoints: ``list_checkpoints`` and ``load_params``.

Both work in a fresh process with any number of devices: arrays come back as numpy, whatever mesh
they were saved from.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from orbax.checkpoint import path as ocp_path

from functrain.checkpoint import layout, reader, retention
from functrain.checkpoint.meta import check_format_version, metric_value, saved_items
from functrain.errors import CheckpointError


@dataclasses.dataclass
class CheckpointInfo:
    """One checkpoint directory as found on disk."""

    step: int
    path: Path
    time: float | None  # unix seconds the save was started (meta), else the directory's mtime
    size: int  # bytes
    whole: bool  # committed and readable
    problem: str | None  # why it is not whole
    metrics: dict = dataclasses.field(default_factory=dict)
    is_best: bool = False
    meta: dict | None = None


def _check(step_path: Path, verify: bool) -> tuple[dict | None, str | None]:
    """``(meta, problem)`` for one committed step; ``verify`` reads every array and checks its checksums."""
    meta = None
    try:
        meta = reader.read_meta(step_path)
        check_format_version(meta, str(step_path))
        targets = dict.fromkeys(saved_items(meta))
        if verify:
            reader.restore_step(step_path, targets)
        else:
            reader.check_compatible(step_path, meta, targets)
        return meta, None
    except reader.DamagedCheckpoint as damaged:
        return meta, damaged.reason
    except CheckpointError as error:  # newer format, or items that do not fit each other
        return meta, str(error)


def _mark_best(infos: list[CheckpointInfo]) -> None:
    """Flag the best whole checkpoints by the metric the newest one was saved with."""
    records = [i.meta["best_metric"] for i in infos if i.meta and isinstance(i.meta.get("best_metric"), dict)]
    if not records:
        return
    name, mode = records[-1].get("name"), records[-1].get("mode", "min")
    count = max(int(records[-1].get("keep_best") or 0), 1)
    values = {i.step: metric_value(i.meta, name) for i in infos if i.whole and i.meta}
    best = set(retention.best_steps(values, count, mode))
    for info in infos:
        info.is_best = info.step in best


def list_checkpoints(run_dir: str | os.PathLike, verify: bool = True) -> list[CheckpointInfo]:
    """Every checkpoint of a run, oldest first, with validity, metrics and best flags.

    ``verify`` reads every array to prove the step restores (slow for big checkpoints); without it
    only meta and array metadata are read. Interrupted (uncommitted) saves are listed as not whole.
    """
    ckpt_dir, _ = layout.locate(run_dir)
    infos = []
    for step in layout.committed_steps(ckpt_dir):
        path = layout.step_dir(ckpt_dir, step)
        meta, problem = _check(path, verify)
        infos.append(
            CheckpointInfo(
                step=step,
                path=path,
                time=(meta or {}).get("time") or path.stat().st_mtime,
                size=layout.dir_size(path),
                whole=problem is None,
                problem=problem,
                metrics=(meta or {}).get("metrics") or {},
                meta=meta,
            )
        )
    for path in layout.uncommitted_dirs(ckpt_dir):
        infos.append(
            CheckpointInfo(
                step=ocp_path.step.step_from_checkpoint_name(path.name),
                path=path,
                time=path.stat().st_mtime,
                size=layout.dir_size(path),
                whole=False,
                problem="uncommitted: save interrupted or in flight",
            )
        )
    infos.sort(key=lambda info: (info.step, info.whole))
    _mark_best(infos)
    return infos


def load_params(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """Parameters of a run's checkpoint as a nested dict of numpy arrays.

    ``run_dir`` may be the run directory, its checkpoints/ directory or one step directory.
    ``step=None`` takes the newest checkpoint that reads cleanly (a damaged newer one is skipped
    with a warning).
    """
    return load_params_and_meta(run_dir, step)[0]


def load_params_and_meta(run_dir: str | os.PathLike, step: int | None = None) -> tuple[dict[str, Any], dict]:
    """:func:`load_params` and the same checkpoint's meta (model config, data position, metrics)."""
    ckpt_dir, step_in_path = layout.locate(run_dir)
    chosen = step if step is not None else step_in_path
    result = reader.restore_newest(
        ckpt_dir, {layout.PARAMS: None}, "auto" if chosen is None else int(chosen), step_key="--step"
    )
    if result is None:
        raise CheckpointError(f"no committed checkpoint in {ckpt_dir}; train first or pass another run.dir")
    items, meta, _ = result
    return items[layout.PARAMS], meta
