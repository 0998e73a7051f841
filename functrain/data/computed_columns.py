"""A source whose records gain fields computed after it was built, from what only the run's start knows (a
preference run's reference log-probs, from the starting weights).

The loader reads them by record index like any other field, so the same record carries the same values in
any order, on any process and after a resume.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from functrain.data.sources import Batch, as_source
from functrain.errors import DataError


class ComputedColumns:
    """``source`` with the fields ``names`` added once :meth:`set` has given their values (one per record)."""

    def __init__(self, source: Any, names: tuple[str, ...]) -> None:
        self.source = as_source(source)
        self.names = names
        self.columns: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.source)

    def set(self, columns: Mapping[str, np.ndarray]) -> None:
        """The added fields' values, ``[len(source), ...]`` each."""
        if sorted(columns) != sorted(self.names):
            raise DataError(f"computed fields {sorted(columns)} are not the expected {sorted(self.names)}")
        for name, column in columns.items():
            if len(column) != len(self.source):
                raise DataError(f"computed field {name!r} has {len(column)} values for {len(self.source)} records")
        self.columns = {name: np.asarray(column) for name, column in columns.items()}

    def gather(self, indices: np.ndarray) -> Batch:
        if self.columns is None:  # a bug, not bad input: the run reads batches only after its start fills these
            raise RuntimeError(f"fields {list(self.names)} were read before they were computed")
        return {**self.source.gather(indices), **{name: column[indices] for name, column in self.columns.items()}}
