"""The documents of ``functrain tokenize``'s inputs, read lazily in batches.

A batch is a list of document texts, or :class:`JsonLines` not yet parsed (parsing is left to the worker
process that encodes them, so the reading process only moves bytes); :func:`texts_of` gives its texts.

What a document is, by input kind:

- ``.jsonl`` / ``.json`` (JSON Lines): one document per line, the string in ``field`` (default ``text``);
- ``.parquet``: one document per row of the column ``field`` (needs pyarrow: ``pip install 'functrain[lm]'``);
- a directory written by ``datasets.Dataset.save_to_disk``: one document per row of ``field``;
- any other file (``.txt``, ``.md``, source code): the whole file is one document (UTF-8).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from functrain.errors import ConfigError, DataError

BATCH_DOCS = 512  # documents per batch handed to a worker: big enough to amortise the hand-over
BATCH_CHARS = 1 << 22


def check_inputs(inputs: list[str]) -> list[Path]:
    """The input paths, each existing (a missing one is a one-line ConfigError)."""
    paths = [Path(item) for item in inputs]
    for path in paths:
        if not path.exists():
            raise ConfigError(
                f"input {str(path)!r} does not exist; pass text, .jsonl or .parquet files or a "
                f"directory written by datasets' save_to_disk"
            )
        if path.is_dir() and not (path / "dataset_info.json").is_file():
            raise ConfigError(
                f"input {str(path)!r} is a directory but not an HF dataset saved with save_to_disk "
                f"(no dataset_info.json); pass its files, or the split directory (e.g. DIR/train)"
            )
    return paths


@dataclass(frozen=True)
class JsonLines:
    """Lines of a JSON Lines file starting at line ``first_line``, each an object with the text in ``field``."""

    path: str
    first_line: int
    lines: list[str]
    field: str

    def texts(self) -> list[str]:
        """The documents, parsed; a line that is not an object with a string ``field`` is a DataError."""
        texts = []
        for number, line in enumerate(self.lines, self.first_line):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                raise DataError(f"{self.path}:{number} is not a JSON object; write one JSON object per line") from None
            text = record.get(self.field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise DataError(
                    f"{self.path}:{number} has no string field {self.field!r}; pass --field NAME for "
                    f"the field that holds the text"
                )
            texts.append(text)
        return texts


Batch = list[str] | JsonLines


def texts_of(batch: Batch) -> list[str]:
    """The document texts of a batch."""
    return batch.texts() if isinstance(batch, JsonLines) else batch


def document_batches(paths: list[Path], field: str = "text") -> Iterator[Batch]:
    """Batches of documents in input order, about :data:`BATCH_DOCS` documents or :data:`BATCH_CHARS`
    characters each."""
    texts: list[str] = []
    size = 0
    for path in paths:
        if path.suffix in (".jsonl", ".json") and not path.is_dir():
            if texts:
                yield texts
                texts, size = [], 0
            yield from _json_line_batches(path, field)
            continue
        for document in _documents(path, field):
            texts.append(document)
            size += len(document)
            if len(texts) == BATCH_DOCS or size >= BATCH_CHARS:
                yield texts
                texts, size = [], 0
    if texts:
        yield texts


def _json_line_batches(path: Path, field: str) -> Iterator[JsonLines]:
    with open(path, encoding="utf-8") as handle:
        lines: list[str] = []
        first_line, size = 1, 0
        for number, line in enumerate(handle, 1):
            lines.append(line)
            size += len(line)
            if len(lines) == BATCH_DOCS or size >= BATCH_CHARS:
                yield JsonLines(str(path), first_line, lines, field)
                lines, first_line, size = [], number + 1, 0
        if lines:
            yield JsonLines(str(path), first_line, lines, field)


def _documents(path: Path, field: str) -> Iterator[str]:
    if path.is_dir():
        yield from _hf_dataset(path, field)
    elif path.suffix == ".parquet":
        yield from _parquet(path, field)
    else:
        try:
            yield path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"input {str(path)!r} is not UTF-8 text; convert it, or give .jsonl/.parquet") from None


def _check_column(path: Path, field: str, columns: list[str]) -> None:
    if field not in columns:
        raise DataError(
            f"input {str(path)!r} has no column {field!r} (columns: {', '.join(columns)}); pass "
            f"--field NAME for the column that holds the text"
        )


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
