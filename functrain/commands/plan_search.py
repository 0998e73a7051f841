"""``functrain plan --search``: the cheapest remat policy that fits, then the largest per-chip batch that fits with
it; each candidate is one ahead-of-time compile (:func:`functrain.plan.planner.plan`), and every one is reported.

Remat policies are tried cheapest first (``none`` recomputes nothing, ``dots_saveable`` the element-wise work,
``full`` whole blocks); the batch then doubles ``data.global_batch_size`` (the micro-batch size with it, so
``train.micro_batches`` is kept) until a candidate does not fit or :data:`MAX_DOUBLINGS` is reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from functrain.config.files import apply_overrides
from functrain.config.load import validate_config
from functrain.config.schema import Config
from functrain.data.global_array import BATCH_AXES
from functrain.plan.planner import Plan, plan

REMAT_COST_ORDER = ("none", "dots_saveable", "full")
MAX_DOUBLINGS = 8


@dataclass(frozen=True)
class Candidate:
    """One compile of the search: the settings tried and what the plan said."""

    remat: str | None
    global_batch_size: int
    plan: Plan

    @property
    def per_chip_batch(self) -> float:
        """Samples per chip per step: the batch over the data-parallel (data x fsdp x expert) chips."""
        return self.global_batch_size / math.prod(self.plan.mesh.get(axis, 1) for axis in BATCH_AXES)


def _with(config: Config, **settings: object) -> Config:
    return validate_config(apply_overrides(config.to_dict(), [f"{key}={value}" for key, value in settings.items()]))


def search(
    config: Config, topology: str | None = None, slices: int | None = None
) -> tuple[list[Candidate], Candidate | None]:
    """Every candidate compiled, and the chosen one (None: nothing fits, or the chips' HBM is unknown)."""
    tried: list[Candidate] = []
    policies = REMAT_COST_ORDER if hasattr(config.model, "remat") else (None,)
    chosen = None
    for policy in policies:
        candidate = config if policy is None else _with(config, **{"model.remat": policy})
        tried.append(Candidate(policy, config.data.global_batch_size, plan(candidate, topology, slices)))
        if tried[-1].plan.fits:
            chosen, config = tried[-1], candidate
            break
        if tried[-1].plan.fits is None:
            return tried, None
    if chosen is None:
        return tried, None
    for _ in range(MAX_DOUBLINGS):
        bigger = _with(config, **{"data.global_batch_size": config.data.global_batch_size * 2})
        tried.append(Candidate(chosen.remat, bigger.data.global_batch_size, plan(bigger, topology, slices)))
        if not tried[-1].plan.fits:
            break
        chosen, config = tried[-1], bigger
    return tried, chosen
