"""Params+meta checkpoints for conversion, through `functrain.checkpoint` (RUN_DIR/checkpoints/<step>/).

A converted model is a step with "params" and "meta" only, so `functrain train` starts a fresh optimizer
from it; an export reads any run's params back as numpy together with the model config in its meta.
"""

from pathlib import Path
from typing import Any


from functrain.checkpoint import Checkpointer, list_checkpoints, load_params
from functrain.errors import CheckpointError


def has_checkpoints(run_dir: Path) -> bool:
    """Whether RUN_DIR/checkpoints holds any step, committed or not."""
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(folder.iterdir())


def save(run_dir: Path, step: int, params: Any, meta: dict[str, Any]) -> None:
    """Write params and meta as checkpoint ``step`` and wait for the atomic commit.

    The save blocks, so numpy leaves are written from their own buffers (no second copy of the model).
    """
    checkpointer = Checkpointer(run_dir, keep=None, async_save=False)
    try:
        checkpointer.save(step, {"params": params}, meta)
    finally:
        checkpointer.close()


def load(run_dir: Path, step: int | None) -> tuple[Any, dict[str, Any]]:
    """(params as numpy arrays, meta) of checkpoint ``step``, or of the newest whole one when None."""
    if not (run_dir / "checkpoints").is_dir():
        raise CheckpointError(f"{run_dir} has no checkpoints/ directory; pass a functrain run directory")
    whole = {info.step: info for info in list_checkpoints(run_dir, verify=False) if info.whole}
    if not whole:
        raise CheckpointError(f"{run_dir} has no complete checkpoint; train or convert into it first")
    step = max(whole) if step is None else step
    if step not in whole:
        raise CheckpointError(f"{run_dir} has no checkpoint at step {step}; available: "
                              f"{', '.join(map(str, sorted(whole)))}")
    return load_params(run_dir, step), whole[step].meta or {}
