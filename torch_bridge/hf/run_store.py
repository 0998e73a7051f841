"""Params+meta checkpoints for conversion, through `functrain.checkpoint` (RUN_DIR/checkpoints/<step>/).

A converted model is a step with "params" and "meta" only, so `functrain train` starts a fresh optimizer
from it. An export reads a run's params and meta back with `functrain.checkpoint.load_params_and_meta`.
"""

from pathlib import Path
from typing import Any

from functrain.checkpoint import Checkpointer
from functrain.checkpoint.layout import checkpoints_dir


def has_checkpoints(run_dir: Path) -> bool:
    """Whether RUN_DIR/checkpoints holds any step, committed or not."""
    folder = checkpoints_dir(run_dir)
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
