"""The lines a run opens with (process 0): where it started from, its config on disk, the config's warnings, its
length, data and devices, and its model FLOPs per token."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from functrain.callbacks.view import RunRecord
from functrain.run.resume import Start, write_run_config

if TYPE_CHECKING:
    from functrain.run.build import Run

log = logging.getLogger("functrain")


def announce_start(run: Run, record: RunRecord, start: Start, step: int, position: int) -> None:
    """Log how the run starts at ``step`` (data position ``position``) and write its config into the run
    directory, once the start is known to be good."""
    if start.restored_step is not None:
        source = start.source or "persistent"
        log.info(
            "resumed from %scheckpoint %d (epoch %d, samples consumed %d%s)",
            "" if source == "persistent" else "local ",
            step,
            run.sampler.epoch_of(position),
            position,
            f"; {source}" if source.startswith("peer") else "",
        )
    elif record.started_from is not None:
        log.info("started from the weights of %s (train.init_from); fresh optimizer state", record.started_from)
    write_run_config(run.run_dir, run.config_record)
    for warning in run.warnings:
        log.warning("functrain: warning: %s", warning)
    records = run.sampler.num_records
    log.info(
        "run %s: steps %d -> %d, epoch %d, samples consumed %d, %s\n%s",
        run.run_dir,
        step,
        run.settings.max_steps,
        record.epoch,
        position,
        "streamed training data" if records is None else f"{records} training records",
        run.backend.describe(),
    )
    if run.speed.flops_per_token:
        log.info("model FLOPs per token (training, causal attention): %.4g", run.speed.flops_per_token)
