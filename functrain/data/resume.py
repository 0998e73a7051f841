"""Where the data continues after a restart, from the checkpoint meta and ``data.ignore_skip`` /
``data.skip_samples``.

Resuming is arithmetic on ``samples_consumed``: the batch size may change between runs and the next batch
still starts at the first unseen sample. The meta records the dataset size and data seed, so a resume onto
different data is caught instead of silently continuing a different order.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from functrain.errors import DataError

if TYPE_CHECKING:
    from functrain.data.kinds import Order


def check_resume(
    meta: Mapping[str, Any] | None,
    num_records: int | None,
    seed: int,
    ignore_skip: bool,
    skip_samples: int | None = None,
) -> None:
    """Raise :class:`DataError` if the checkpoint meta was written for a different dataset size or data seed.

    Nothing is checked without meta, with ``ignore_skip`` (the data order restarts anyway) or with an explicit
    ``skip_samples`` (the user chose the position), nor for fields the meta lacks (e.g. a converted model).
    """
    if not meta or ignore_skip or skip_samples is not None:
        return
    how = (
        "set data.ignore_skip=true to restart the data from the beginning (model and optimizer are kept), "
        "or use the original data"
    )
    saved_records = meta.get("num_records")
    if saved_records is not None and int(saved_records) != num_records:
        raise DataError(
            f"the checkpoint was trained on {saved_records} records but the data now has {num_records}; {how}"
        )
    saved_seed = meta.get("data_seed")
    if saved_seed is not None and int(saved_seed) != seed:
        raise DataError(
            f"the checkpoint was trained with data seed {saved_seed} but the run now uses seed {seed}; {how} and seed"
        )


def resume_position(meta: Mapping[str, Any] | None, ignore_skip: bool, skip_samples: int | None) -> int:
    """The position (samples consumed) to start the data at.

    ``skip_samples`` wins when set; otherwise 0 with ``ignore_skip`` or without meta; otherwise the meta's
    ``samples_consumed``.
    """
    if skip_samples is not None:
        if skip_samples < 0:
            raise DataError(f"data.skip_samples={skip_samples} is negative; set it to 0 or more")
        return int(skip_samples)
    if ignore_skip or not meta:
        return 0
    return int(meta.get("samples_consumed", 0))


def data_meta(
    sampler: Order, position: int, previous: Mapping[str, Any] | None = None, jump: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The data fields of a checkpoint meta at ``position``: samples_consumed, epoch, global_batch_size,
    global_batch_sizes (history, extended when the size changed since ``previous`` meta), num_records,
    data_seed, position_jumps (history of ``data.skip_samples`` moves, ``jump`` = ``{"step", "from",
    "to"}`` of this run's, so a rewind past a loss spike stays on record in every later checkpoint) and the
    order's own fields (``sampler.extra_meta``: a mixture's schedule, a stream's state)."""
    previous = previous or {}
    history = list(
        previous.get("global_batch_sizes")
        or ([previous["global_batch_size"]] if previous.get("global_batch_size") is not None else [])
    )
    if not history or history[-1] != sampler.global_batch_size:
        history.append(sampler.global_batch_size)
    jumps = list(previous.get("position_jumps") or [])
    if jump is not None and dict(jump) not in jumps:
        jumps.append(dict(jump))
    return {
        "samples_consumed": int(position),
        "epoch": sampler.epoch_of(position),
        "global_batch_size": sampler.global_batch_size,
        "global_batch_sizes": history,
        "num_records": sampler.num_records,
        "data_seed": sampler.seed,
        "position_jumps": jumps,
        **sampler.extra_meta(position),
    }
