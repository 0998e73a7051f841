"""Checks at the data edge: what the model and loss read must be there, of the right kind and in range.

An embedding lookup clamps an out-of-range token id, and a cross-entropy of a label >= classes or a NaN input
is NaN (so every step on it is skipped as non-finite): all train on silently. :class:`BatchCheck` is built from
what the task reads and runs where batches are assembled (the prefetch thread), vectorised: one min and one max
per checked field (integers in range, numbers finite).
A bad batch raises a one-line :class:`~functrain.errors.DataError` naming the record and field before the step
that would use it is dispatched, so nothing computed from it is ever saved.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from functrain.errors import DataError


@dataclass(frozen=True)
class FieldRule:
    """What one batch field must hold: an integer in ``[0, upper)`` (``upper`` None: any non-negative
    integer), or (``integer`` False) any number. ``bound_key`` names the config key behind ``upper``."""

    name: str
    integer: bool = True
    upper: int | None = None
    bound_key: str = ""
    what: str = "value"


class BatchCheck:
    """Validates batches (dicts of arrays with a leading record axis) against a list of :class:`FieldRule`.

    ``check_fields`` looks at names and dtypes only (call it once, on the first batch); calling the object
    checks value ranges too and names the first offending record, given the batch's record indices.
    """

    def __init__(self, rules: list[FieldRule], source: str = "the data") -> None:
        self.rules = list(rules)
        self.source = source

    def check_fields(self, batch: Mapping[str, np.ndarray]) -> None:
        """Every field the model reads is present and of a usable dtype."""
        for rule in self.rules:
            if rule.name not in batch:
                present = ", ".join(sorted(k for k in batch if k != "weight")) or "none"
                raise DataError(
                    f"{self.source} has no field {rule.name!r} (the model reads its {rule.what}s there); "
                    f"fields present: {present}; provide {rule.name!r} or choose a model that fits the "
                    f"data"
                )
            values = np.asarray(batch[rule.name])
            if rule.integer and not np.issubdtype(values.dtype, np.integer):
                raise DataError(
                    f"{self.source} field {rule.name!r} has dtype {values.dtype}, but {rule.what}s must "
                    f"be integers; convert it (e.g. .astype(np.int32)) when you write the data"
                )
            if not rule.integer and not (np.issubdtype(values.dtype, np.number) or values.dtype == np.bool_):
                raise DataError(
                    f"{self.source} field {rule.name!r} has dtype {values.dtype}, which is not numeric; "
                    f"store numbers in {rule.name!r}"
                )

    def __call__(self, batch: Mapping[str, np.ndarray], records: np.ndarray | None = None) -> None:
        """Raise a DataError naming the first record whose field is out of range (``records`` maps rows to
        record indices; None: rows are record indices)."""
        for rule in self.rules:
            values = batch[rule.name]
            if not values.size:
                continue
            if not rule.integer:
                self._check_finite(rule, values, records)
                continue
            low, high = values.min(), values.max()
            if low >= 0 and (rule.upper is None or high < rule.upper):
                continue
            bad = (values < 0) if rule.upper is None else (values < 0) | (values >= rule.upper)
            row = int(np.flatnonzero(bad.reshape(len(values), -1).any(axis=1))[0])
            value = int(values.reshape(len(values), -1)[row][bad.reshape(len(values), -1)[row]][0])
            record = row if records is None else int(np.asarray(records)[row])
            allowed = (
                f"0 <= {rule.what} < {rule.upper} ({rule.bound_key})"
                if rule.upper is not None
                else f"{rule.what}s >= 0"
            )
            fix = (
                f"fix the data or raise {rule.bound_key} to at least {value + 1}"
                if rule.upper is not None and value >= 0
                else "fix the data"
            )
            raise DataError(
                f"{self.source} record {record} field {rule.name!r} holds {rule.what} {value}, outside {allowed}; {fix}"
            )

    def _check_finite(self, rule: FieldRule, values: np.ndarray, records: np.ndarray | None) -> None:
        """A NaN or infinity in a number field makes every step on its batch non-finite (skipped, epoch after
        epoch, and blamed on the learning rate): name the record instead. min and max propagate NaN."""
        if values.dtype.kind in "biu" or (np.isfinite(values.min()) and np.isfinite(values.max())):
            return
        bad = ~np.isfinite(values.reshape(len(values), -1))
        row = int(np.flatnonzero(bad.any(axis=1))[0])
        value = values.reshape(len(values), -1)[row][bad[row]][0]
        record = row if records is None else int(np.asarray(records)[row])
        raise DataError(
            f"{self.source} record {record} field {rule.name!r} holds {value}, but {rule.what}s must be finite "
            f"numbers (a step on it is skipped as non-finite, every epoch); fix or drop that record"
        )


def check_arrays(check: BatchCheck | None, arrays: Mapping[str, np.ndarray]) -> None:
    """Check whole in-memory arrays up front (fields, dtypes and ranges), so bad records are reported before
    the first step; memory-mapped or lazy sources are left to the per-batch check."""
    if check is None or not arrays:
        return
    check.check_fields(arrays)
    if all(type(value) is np.ndarray for value in arrays.values()):
        check(arrays)
