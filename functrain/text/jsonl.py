"""Reading a JSONL data file one record at a time, each malformed line a one-line DataError naming it."""

import json
import os
from pathlib import Path
from typing import Any, Iterator

from functrain.errors import DataError


def jsonl_records(path: str | os.PathLike, what: str, path_key: str) -> Iterator[tuple[str, int, Any]]:
    """``(where, line number, record)`` for each non-blank line of the ``what`` file at ``path`` (``where`` names
    the file and line for error messages); a missing file names ``path_key`` to fix, a line that is not JSON is
    named."""
    file = Path(path)
    if file.is_dir():
        raise DataError(f"{what} file {str(file)!r} is a directory; point {path_key} at the .jsonl file")
    if not file.is_file():
        raise DataError(f"{what} file {str(file)!r} does not exist; fix {path_key}")
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where} is not JSON ({err.msg}); write one JSON object per line") from None
        yield where, number, record
