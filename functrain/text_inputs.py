"""The documents of ``functrain tokenize``'s inputs, read lazily in batches.

What a document is, by input kind:

- ``.jsonl`` / ``.json`` (JSON Lines): one document per line, the string in ``field`` (default ``text``);
- ``.parquet``: one document per row of the column ``field`` (needs pyarrow: ``pip install 'functrain[lm]'``);
- a directory written by ``datasets.Dataset.save_to_disk``: one document per row of ``field``;
- any other file (``.txt``, ``.md``, source code): the whole file is one document (UTF-8).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from functrain.errors import ConfigError, DataError

BATCH_DOCS = 512  # documents per batch handed to a worker: big enough to amortise the hand-over
BATCH_CHARS = 1 << 22


def check_inputs(inputs: list[str]) -> list[Path]:
    """The input paths, each existing (a missing one is a one-line ConfigError)."""
    paths = [Path(item) for item in inputs]
    for path in paths:
        if not path.exists():
            raise ConfigError(f"input {str(path)!r} does not exist; pass text, .jsonl or .parquet files or a "
                              f"directory written by datasets' save_to_disk")
        if path.is_dir() and not (path / "dataset_info.json").is_file():
            raise ConfigError(f"input {str(path)!r} is a directory but not an HF dataset saved with save_to_disk "
                              f"(no dataset_info.json); pass its files, or the split directory (e.g. DIR/train)")
    return paths


def document_batches(paths: list[Path], field: str = "text") -> Iterator[list[str]]:
    """Lists of documents, in input order, about :data:`BATCH_DOCS` documents or :data:`BATCH_CHARS`
    characters each."""
    batch: list[str] = []
    size = 0
    for path in paths:
        for document in _documents(path, field):
            batch.append(document)
            size += len(document)
            if len(batch) == BATCH_DOCS or size >= BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _documents(path: Path, field: str) -> Iterator[str]:
    if path.is_dir():
        yield from _hf_dataset(path, field)
    elif path.suffix in (".jsonl", ".json"):
        yield from _json_lines(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"input {str(path)!r} is not UTF-8 text; convert it, or give .jsonl/.parquet") from None


def _json_lines(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{path}:{number} is not a JSON object; write one JSON object per line") from None
            text = record.get(field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number} has no string field {field!r}; pass --field NAME for the field "
                                f"that holds the text")
            yield text


def _check_column(path: Path, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise DataError(f"input {str(path)!r} has no column {field!r} (columns: {', '.join(columns)}); pass "
                        f"--field NAME for the column that holds the text")


def _parquet(path: Path, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ConfigError(f"reading {str(path)!r} needs pyarrow; pip install 'functrain[lm]'") from None
    table = parquet.ParquetFile(path)
    _check_column(path, field, table.schema_arrow.names)
    for record_batch in table.iter_batches(batch_size=BATCH_DOCS, columns=[field]):
        yield from record_batch.column(0).to_pylist()


def _hf_dataset(path: Path, field: str) -> Iterator[str]:
    try:
        from datasets import load_from_disk
    except ImportError:
        raise ConfigError(f"reading {str(path)!r} needs the HF datasets library; pip install datasets") from None
    dataset = load_from_disk(str(path))
    _check_column(path, field, list(dataset.column_names))
    for rows in dataset.select_columns([field]).iter(batch_size=BATCH_DOCS):
        yield from rows[field]
