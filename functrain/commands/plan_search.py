"""``functrain plan --search``: the cheapest remat policy that fits, then the largest per-chip batch that fits with
it; each candidate is one ahead-of-time compile (:func:`functrain.plan.planner.plan`), and every one is reported.

Remat policies are tried cheapest first (``none`` recomputes nothing, ``dots_saveable`` the element-wise work,
``full`` whole blocks). The batch then grows by doublings of ``data.global_batch_size`` (the micro-batch size with
it, so ``train.micro_batches`` is kept), at most :data:`MAX_DOUBLINGS`. What the candidates share is reused rather
than compiled again: the TPU topology is described once, and the fitting candidate's memory (state, which the batch
does not change, and the rest, which grows with it) predicts the largest doubling that fits; that one is compiled,
then the next doubling to confirm it does not fit (or, where the prediction was off, the search steps on from there
one doubling at a time). Where memory grows with the batch as predicted, the batch takes two compiles, where
doubling from the start took one per doubling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from functrain.config.files import apply_overrides
from functrain.config.load import validate_config
from functrain.config.schema import Config
from functrain.data.global_array import BATCH_AXES
from functrain.plan.planner import HBM_USABLE, Plan, plan, topology_devices

REMAT_COST_ORDER = ("none", "dots_saveable", "full")
MAX_DOUBLINGS = 8
# The parts of a chip's memory that a bigger batch leaves as they are.
STATE_PARTS = ("params", "optimizer", "model_state")


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


def predicted_doublings(fitting: Plan) -> int:
    """How many doublings of the batch still fit, by a fitting plan's memory: the state stays, the rest (batch,
    activations) doubles with the batch. At least 1 (the next doubling is compiled to know), at most
    :data:`MAX_DOUBLINGS`."""
    sizes, hbm = fitting.per_chip_bytes, fitting.hbm_bytes
    state = sum(sizes[part] for part in STATE_PARTS)
    growing = sizes["total"] - state
    if not hbm or growing <= 0:
        return 1
    room = (HBM_USABLE * hbm - state) / growing  # how many times the growing part fits
    return min(MAX_DOUBLINGS, max(1, int(math.floor(math.log2(room))) if room >= 1 else 1))


def search(
    config: Config, topology: str | None = None, slices: int | None = None
) -> tuple[list[Candidate], Candidate | None]:
    """Every candidate compiled, and the chosen one (None: nothing fits, or the chips' HBM is unknown)."""
    devices = topology_devices(topology, slices or 1) if topology else None
    tried: list[Candidate] = []

    def attempt(candidate_config: Config, remat: str | None) -> Candidate:
        candidate = Candidate(
            remat, candidate_config.data.global_batch_size, plan(candidate_config, topology, slices, devices=devices)
        )
        tried.append(candidate)
        return candidate

    policies = REMAT_COST_ORDER if hasattr(config.model, "remat") else (None,)
    chosen = None
    for policy in policies:
        candidate = config if policy is None else _with(config, **{"model.remat": policy})
        result = attempt(candidate, policy)
        if result.plan.fits:
            chosen, config = result, candidate
            break
        if result.plan.fits is None:
            return tried, None
    if chosen is None:
        return tried, None
    return tried, _largest_batch(config, chosen, attempt)


def _largest_batch(config: Config, chosen: Candidate, attempt: Callable[[Config, str | None], Candidate]) -> Candidate:
    """The largest doubling of ``chosen``'s batch that fits: the predicted one first, then one doubling at a time up
    (while they fit) or down (until one fits), between the largest known to fit and the smallest known not to."""
    base = config.data.global_batch_size
    fitting, too_big = 0, MAX_DOUBLINGS + 1
    trial = predicted_doublings(chosen.plan)
    while too_big - fitting > 1:
        result = attempt(_with(config, **{"data.global_batch_size": base * 2**trial}), chosen.remat)
        if result.plan.fits:
            chosen, fitting, trial = result, trial, trial + 1
        else:
            too_big, trial = trial, trial - 1
    return chosen
