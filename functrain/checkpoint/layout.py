"""Where checkpoints live on disk: RUN_DIR/checkpoints/<step>/{params,state,meta}, and ``experience`` where a task's
experience stage made batches ahead (asynchronous GRPO's).

Only committed steps are listed. Orbax writes a step into ``<step>.orbax-checkpoint-tmp*`` and
renames it on commit, so a half-written step never has a plain integer name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from orbax.checkpoint import path as ocp_path

from functrain.errors import CheckpointError

CHECKPOINTS_SUBDIR = "checkpoints"
PARAMS, STATE, META = "params", "state", "meta"
EXPERIENCE = "experience"  # the batches an experience stage made ahead of the checkpoint's step
_STEP_NAME = re.compile(r"^(0|[1-9]\d*)$")


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    """RUN_DIR/checkpoints."""
    return Path(run_dir).absolute() / CHECKPOINTS_SUBDIR  # Orbax refuses relative paths


def step_dir(ckpt_dir: Path, step: int) -> Path:
    """The directory of committed step ``step``."""
    return ckpt_dir / str(step)


def committed_steps(ckpt_dir: Path) -> list[int]:
    """Committed steps under ``ckpt_dir``, oldest first (temporary, uncommitted dirs excluded)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in ckpt_dir.iterdir()
        if _STEP_NAME.match(p.name) and p.is_dir() and ocp_path.step.is_path_finalized(p)
    )


def uncommitted_dirs(ckpt_dir: Path) -> list[Path]:
    """Orbax temporary step directories: saves that were interrupted or are still in flight."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if ocp_path.step.is_path_temporary(p))


def dir_size(path: Path) -> int:
    """Total bytes of the regular files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def locate(path: str | os.PathLike) -> tuple[Path, int | None]:
    """Resolve a run dir, its checkpoints dir, or one step dir to ``(checkpoints_dir, step or None)``.

    The result is absolute (Orbax refuses relative paths), so a path relative to the working directory works.
    Raises ``CheckpointError`` when ``path`` holds no functrain checkpoint at all.
    """
    path = Path(path).absolute()
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass the run.dir of a training run (the directory that holds checkpoints/)"
        )
    if (path / CHECKPOINTS_SUBDIR).is_dir():
        return path / CHECKPOINTS_SUBDIR, None
    if _STEP_NAME.match(path.name) and (path / META).is_dir():
        return path.parent, int(path.name)
    if path.is_dir() and (committed_steps(path) or uncommitted_dirs(path)):
        return path, None
    raise CheckpointError(
        f"{path} is not a functrain checkpoint: no checkpoints/ directory or "
        f"<step>/ directories inside; pass the run.dir of a training run"
    )
