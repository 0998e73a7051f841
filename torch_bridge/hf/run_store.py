"""Minimal params+meta checkpoint I/O in functrain's run-directory layout.

RUN_DIR/checkpoints/<step>/ is an Orbax CheckpointManager step with items "params" (StandardSave) and
"meta" (JsonSave), the layout `functrain.checkpoint` reads and writes; this module only covers what
conversion needs (a params-only step, and reading params back as numpy).
"""

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from functrain.errors import CheckpointError

CHECKPOINTS = "checkpoints"


def _manager(run_dir: Path) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(
        run_dir / CHECKPOINTS,
        item_handlers={"params": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))


def has_checkpoints(run_dir: Path) -> bool:
    """Whether RUN_DIR/checkpoints holds any step directory."""
    folder = run_dir / CHECKPOINTS
    return folder.is_dir() and any(folder.iterdir())


def save(run_dir: Path, step: int, params: Any, meta: dict[str, Any]) -> None:
    """Write params and meta as checkpoint ``step`` (atomic: Orbax commits by renaming)."""
    manager = _manager(run_dir)
    try:
        manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                   meta=ocp.args.JsonSave(meta)))
        manager.wait_until_finished()
    finally:
        manager.close()


def load(run_dir: Path, step: int | None) -> tuple[Any, dict[str, Any]]:
    """(params as numpy arrays, meta) of checkpoint ``step``, or of the newest one when ``step`` is None."""
    if not (run_dir / CHECKPOINTS).is_dir():
        raise CheckpointError(f"{run_dir} has no checkpoints/ directory; pass a functrain run directory")
    manager = ocp.CheckpointManager(
        run_dir / CHECKPOINTS,
        item_handlers={"params": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        steps = manager.all_steps()
        if not steps:
            raise CheckpointError(f"{run_dir} has no complete checkpoint; train or convert into it first")
        step = max(steps) if step is None else step
        if step not in steps:
            raise CheckpointError(f"{run_dir} has no checkpoint at step {step}; available: "
                                  f"{', '.join(map(str, sorted(steps)))}")
        # Restore onto plain numpy arrays of the saved shapes: export needs host data, not devices.
        metadata = manager.item_metadata(step)["params"]
        target = jax.tree.map(lambda m: np.empty(m.shape, m.dtype), metadata.tree
                              if hasattr(metadata, "tree") else metadata)
        restored = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target),
                                                                 meta=ocp.args.JsonRestore()))
    finally:
        manager.close()
    return restored["params"], restored["meta"]
