"""Which committed checkpoints to delete: keep the latest N plus the best M by a metric.

Our own policy instead of Orbax's ``best_fn`` + ``max_to_keep`` (orbax #526: that combination keeps
only the best N and can delete the newest checkpoint). Pure functions; the manager applies them only
after a new step has committed.
"""

from __future__ import annotations

from typing import Mapping


def best_steps(metrics: Mapping[int, float | None], count: int, mode: str) -> list[int]:
    """The ``count`` best steps by metric (``mode`` "min" or "max"); ties go to the newer step."""
    if count <= 0:
        return []
    scored = [(value, step) for step, value in metrics.items() if value is not None]
    if mode == "min":
        scored.sort(key=lambda vs: (vs[0], -vs[1]))
    else:
        scored.sort(key=lambda vs: (-vs[0], -vs[1]))
    return [step for _, step in scored[:count]]


def steps_to_delete(
    steps: list[int],
    *,
    keep: int | None,
    keep_best: int,
    metrics: Mapping[int, float | None],
    mode: str,
    protected: set[int],
) -> list[int]:
    """Committed ``steps`` that retention may delete, oldest first.

    Kept: the latest ``keep`` (``None`` keeps everything), the ``keep_best`` best by ``metrics``
    (steps without a value never count as best), the newest step, and every ``protected`` step
    (e.g. the one this run resumed from).
    """
    if keep is None or not steps:
        return []
    ordered = sorted(steps)
    kept = set(ordered[-max(keep, 1) :]) | set(protected)
    kept |= set(best_steps({s: metrics.get(s) for s in ordered}, keep_best, mode))
    return [s for s in ordered if s not in kept]
