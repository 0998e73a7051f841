"""``preference.precompute_ref``: the reference's log-probs of every pair, computed once before the first step
and saved beside the run, as TRL's ``precompute_ref_log_probs`` does.

A fresh run computes them from its starting state (after ``preference.init_from``'s weights are in place) over
the train and the eval pairs, a global batch at a time, with the program's compiled ``precompute`` (the forward
the in-step reference would run), and writes ``RUN_DIR/reference_logps.npz`` atomically. The batches then carry
them by record index (TRL's ``ref_chosen_logps`` / ``ref_rejected_logps``), so the state holds no reference
weights. A resumed run reads the file back, never recomputes (the checkpoint no longer holds the starting
weights). The file records what identifies it: the number of train and eval pairs and a digest of their tokens,
a digest of the starting weights and the compute dtype. A file that does not fit the data (or, on a fresh start,
the weights) is a one-line error naming it and the fix; nothing is deleted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from functrain.data import BatchLoader, IndexSampler, Source
from functrain.data.computed_columns import ComputedColumns
from functrain.errors import CheckpointError, DataError
from functrain.tasks.preference.loss import REFERENCE_LOGPS

log = logging.getLogger("functrain")

FILE_NAME = "reference_logps.npz"
SPLITS = ("train", "eval")


def with_reference_fields(example_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``example_batch`` with the fields the batches of a precomputed run carry (zeros: the step is built for
    their shapes only)."""
    rows = len(example_batch["chosen"])
    return {**example_batch, **{name: np.zeros(rows, np.float32) for name in REFERENCE_LOGPS}}


def data_digest(sources: dict[str, Source | None]) -> str:
    """SHA-256 of the tokenised pairs of each split, field by field (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256()
    for split, source in sources.items():
        if source is None:
            continue
        arrays = source.gather(np.arange(len(source)))
        for name in sorted(arrays):
            array = np.ascontiguousarray(arrays[name])
            digest.update(f"{split}\0{name}\0{array.dtype.name}\0{array.shape}\0".encode())
            digest.update(array.tobytes())
    return digest.hexdigest()


@dataclass
class PrecomputedReference:
    """The preference task's start hook: fills the train and eval data's reference log-probs once the start is
    known (see :class:`functrain.tasks.base.StartHook`).

    ``sources``: the tokenised pairs of each split (None: no eval pairs); ``columns``: the same wrapped as
    :class:`ComputedColumns`, which the loaders read; ``reference_logps``: ``fn(params, model_state, batch)``
    giving a batch's values (:func:`functrain.tasks.preference.loss.precomputed_reference_logps`)."""

    run_dir: Path
    sources: dict[str, Source | None]
    columns: dict[str, ComputedColumns | None]
    global_batch_size: int
    compute_dtype: str
    reference_logps: Callable

    @property
    def path(self) -> Path:
        return self.run_dir / FILE_NAME

    def __call__(self, backend: Any, state: Any, restored_step: int | None) -> Any:
        """Read the file (a resumed run, or a fresh one whose file fits), else compute and write it; then hand
        the values to the data. The state is returned as it came."""
        pairs = {split: 0 if source is None else len(source) for split, source in self.sources.items()}
        identity = {**{f"{split}_pairs": n for split, n in pairs.items()}, "data_digest": data_digest(self.sources)}
        if restored_step is None:
            identity.update(weights_digest=backend.params_digest(state), compute_dtype=self.compute_dtype)
        if restored_step is not None and not self.path.exists():
            raise CheckpointError(
                f"{self.path} is missing: the run resumes from checkpoint {restored_step}, and its "
                f"reference log-probs came from the starting weights, which no checkpoint holds; "
                f"restore the file, or start again in a new run.dir"
            )
        counted = " and ".join(f"{n} {split} pairs" for split, n in pairs.items() if n)
        if self.path.exists():
            values = self._read(identity, restored_step is not None)
            log.info("reference log-probs of %s read from %s", counted, self.path)
        else:
            started = time.perf_counter()
            compute = backend.batch_function(self.reference_logps)
            values = {
                split: self._compute(backend, compute, state, source)
                for split, source in self.sources.items()
                if source is not None
            }
            if backend.process_index == 0:
                self._write(values, identity)
            log.info(
                "reference log-probs of %s computed in %.1fs, saved to %s",
                counted,
                time.perf_counter() - started,
                self.path,
            )
        for split, columns in self.columns.items():
            if columns is not None:
                columns.set(values[split])
        return state

    def _compute(self, backend: Any, compute: Callable, state: Any, source: Source) -> dict[str, np.ndarray]:
        """The reference log-probs ``[N]`` of every pair of ``source``, a global batch at a time in record order
        (the last batch padded with pairs from the start, whose values are dropped)."""
        order = IndexSampler(len(source), self.global_batch_size, 0, shuffle=False, last_batch="pad")
        loader = BatchLoader(source, order, backend.process_index, backend.process_count, prefetch=0)
        parts, position = [], 0
        for _ in range(order.steps_per_epoch):
            host_batch, position = loader.host_batch(position)
            parts.append(compute(state, host_batch))
        return {
            name: np.concatenate([part[name] for part in parts])[: len(source)].astype(np.float32)
            for name in REFERENCE_LOGPS
        }

    def _write(self, values: dict[str, dict[str, np.ndarray]], identity: dict[str, Any]) -> None:
        """The values and what identifies them, written to a temporary file and renamed (never half a file)."""
        arrays: dict[str, Any] = {
            f"{split}_{name}": column  # Any: numpy's savez stub reads **kwds as options
            for split, columns in values.items()
            for name, column in columns.items()
        }
        arrays.update({key: np.asarray(value) for key, value in identity.items()})
        self.run_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.run_dir / f".{FILE_NAME}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as file:
                np.savez(file, **arrays)
            tmp.replace(self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self, identity: dict[str, Any], resumed: bool) -> dict[str, dict[str, np.ndarray]]:
        """The file's values, after checking it was computed for this data (and, on a fresh start, from these
        weights)."""
        fix = (
            "point data.path at the pairs this run started with, or start again in a new run.dir"
            if resumed
            else f"delete {self.path} to compute them again from this run's start, or use a new run.dir"
        )
        try:
            with np.load(self.path, allow_pickle=False) as saved:
                stored = {key: saved[key].item() if saved[key].ndim == 0 else saved[key] for key in saved.files}
        except (OSError, ValueError) as exc:
            raise DataError(f"{self.path} cannot be read ({exc}); {fix}") from None
        for key, wanted in identity.items():
            found = stored.get(key)
            if found != wanted:
                what = {
                    "train_pairs": f"it holds {found} train pairs and the data has {wanted}",
                    "eval_pairs": f"it holds {found} eval pairs and the data has {wanted}",
                    "data_digest": "the tokenised pairs differ (data.path or its tokenisation changed)",
                    "weights_digest": "it was computed from other starting weights",
                    "compute_dtype": f"it was computed in {found} and train.compute_dtype is {wanted}",
                }[key]
                raise DataError(f"{self.path} does not fit this run: {what}; {fix}")
        return {
            split: {name: stored[f"{split}_{name}"] for name in REFERENCE_LOGPS}
            for split in SPLITS
            if identity[f"{split}_pairs"]
        }
