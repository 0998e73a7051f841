"""Bundled and file-backed datasets: nothing to download.

- ``digits``: scikit-learn's bundled 8x8 digits (1797 images, 10 classes), features scaled to [0, 1].
- ``char_text``: byte-level text from the Python documentation that ships with Python
  (``pydoc_data.topics``), or any UTF-8 text file given as ``data.path``; records are windows of
  ``seq_len + 1`` bytes.
- ``array_file``: a ``.npz`` file with ``x``/``y`` (classification) or ``tokens`` (language modelling).
- ``tokens``: a token store written by ``functrain tokenize`` (see :mod:`functrain.data.token_windows`; it is
  opened as sources, not loaded as arrays).
- ``synthetic``: random token ids below ``model.vocab_size`` (see :mod:`functrain.data.synthetic`; computed
  per batch, not loaded).

Each loader returns ``(train, eval)`` as dicts of numpy arrays with a leading record dimension; the
evaluation split is the last ``data.eval_fraction`` of the records, so it never depends on the seed.
"""

import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.token_windows import token_splits
from functrain.errors import DataError

Arrays = dict[str, np.ndarray]


def split_records(arrays: Arrays, eval_fraction: float) -> tuple[Arrays, Arrays]:
    """``(train, eval)``: the last ``eval_fraction`` of the records evaluate (independent of the seed)."""
    num_records = len(next(iter(arrays.values())))
    num_eval = int(round(num_records * eval_fraction))
    cut = num_records - num_eval
    return ({k: v[:cut] for k, v in arrays.items()}, {k: v[cut:] for k, v in arrays.items()})


DIGITS_FILE = Path(__file__).with_name("bundled") / "digits.npz"  # scikit-learn's load_digits, see its README


def _digits(data_config: Any) -> Arrays:
    with np.load(DIGITS_FILE) as digits:
        pixels, labels = digits["pixels"], digits["labels"]
    # The bundled file is ordered by writer; a fixed permutation mixes writers into both splits.
    order = np.random.default_rng(0).permutation(len(labels))
    return {"x": (pixels[order] / 16.0).astype(np.float32), "y": labels[order].astype(np.int32)}


def bundled_text() -> str:
    """The Python documentation topics that ship with every CPython (about 800 KB of English text)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def text_windows(text: str, seq_len: int) -> Arrays:
    """Non-overlapping windows of ``seq_len + 1`` UTF-8 bytes (inputs plus the shifted targets)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    num_records = (len(data) - 1) // seq_len
    if num_records < 1:
        raise DataError(
            f"the text has {len(data)} bytes, fewer than data.seq_len + 1 = {seq_len + 1}; "
            f"use a longer text or a smaller data.seq_len"
        )
    starts = np.arange(num_records) * seq_len
    tokens = data[starts[:, None] + np.arange(seq_len + 1)[None, :]].astype(np.int32)
    return {"tokens": tokens}


def _existing_path(data_config: Any) -> Path:
    if not data_config.path:
        raise DataError(f"data.name={data_config.name} needs data.path; set data.path=FILE")
    path = Path(data_config.path)
    if path.is_dir():
        raise DataError(
            f"data.path={str(path)!r} is a directory, and data.name={data_config.name} reads one file; point "
            f"data.path at the file (a token store directory is data.name=tokens)"
        )
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist; fix data.path or create the file")
    return path


def _char_text(data_config: Any) -> Arrays:
    if data_config.path:
        path = _existing_path(data_config)
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(
                f"data file {str(path)!r} is not UTF-8 text; convert it or use data.name=array_file"
            ) from None
    else:
        text = bundled_text()
    return text_windows(text, data_config.seq_len)


def _array_file(data_config: Any) -> Arrays:
    path = _existing_path(data_config)
    how = "write it with numpy.savez(path, tokens=...) or numpy.savez(path, x=..., y=...)"
    try:
        archive = np.load(path)
        if not isinstance(archive, np.lib.npyio.NpzFile):  # a .npy file: one unnamed array
            raise DataError(f"data file {str(path)!r} holds one unnamed array, not an .npz archive; {how}")
        with archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        reason = "the file is empty" if path.stat().st_size == 0 else (str(exc) or type(exc).__name__)
        raise DataError(f"data file {str(path)!r} is not a readable .npz archive ({reason}); {how}") from None
    if not arrays:
        raise DataError(f"data file {str(path)!r} holds no arrays; {how}")
    lengths = {key: len(value) for key, value in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(
            f"arrays in {str(path)!r} have different record counts {lengths}; "
            f"every array needs the same first dimension"
        )
    return arrays


LOADERS = {"digits": _digits, "char_text": _char_text, "array_file": _array_file}


# Loaders of one file or store each, by name, for the entries of data.sources: ``opener(data_config with .path
# set, the model's vocab_size or None)`` returns a dict of arrays (split by data.eval_fraction here) or a
# (train, eval or None) pair of sources. A new kind of store (a token store) adds its opener here and its
# suffix or marker to source_kind.
def token_store(data_config: Any, vocab_size: int | None) -> tuple[Any, Any]:
    """``data.name: tokens``: the (train, eval or None) windows of the token store at ``data.path``."""
    if not data_config.path:
        raise DataError("data.name=tokens needs data.path; set data.path=STORE (written by functrain tokenize)")
    return token_splits(
        data_config.path, data_config.seq_len, data_config.packing, data_config.eval_fraction, vocab_size
    )


SOURCE_OPENERS: dict[str, Callable[[Any, int | None], Any]] = {
    "array_file": lambda data_config, vocab_size: _array_file(data_config),
    "tokens": token_store,
}


def source_kind(path: Path) -> str | None:
    """The opener for a path without an explicit ``name``: ``.npz`` files are array files, directories token
    stores."""
    return "array_file" if path.suffix == ".npz" else "tokens" if path.is_dir() else None


def open_source(path: str, name: str | None, data_config: Any, vocab_size: int | None = None) -> tuple[Any, Any]:
    """The (train, eval) parts of one ``data.sources`` entry, split like ``data.name`` data (the last
    ``data.eval_fraction`` of its records evaluate); a missing path or unknown kind is a one-line DataError."""
    where = Path(path)
    if not where.exists():
        raise DataError(f"data.sources path {path!r} does not exist; fix the path or remove the entry")
    kind = name or source_kind(where)
    if kind not in SOURCE_OPENERS:
        what = f"name {name!r}" if name else f"suffix {where.suffix!r}"
        raise DataError(
            f"data.sources path {path!r}: no loader for its {what}; give the entry a 'name', one of "
            f"{', '.join(sorted(SOURCE_OPENERS))} (.npz files are array_file)"
        )
    opened = SOURCE_OPENERS[kind](data_config.model_copy(update={"path": str(where), "sources": None}), vocab_size)
    if isinstance(opened, dict):
        train, evaluation = split_records(opened, data_config.eval_fraction)
        if len(next(iter(train.values()))) == 0:
            raise DataError(f"data.sources path {path!r} has no training records; add data or lower data.eval_fraction")
        return train, (evaluation if len(next(iter(evaluation.values()))) else None)
    return opened


def load_dataset(data_config: Any) -> tuple[Arrays, Arrays]:
    """The (train, eval) arrays named by a ``data`` config section."""
    if data_config.name not in LOADERS:
        names = sorted([*LOADERS, "synthetic", "tokens"])  # the last two are sources (functrain.run.parts)
        raise DataError(f"unknown data.name {data_config.name!r}; choose one of {', '.join(names)}")
    arrays = LOADERS[data_config.name](data_config)
    train, evaluation = split_records(arrays, data_config.eval_fraction)
    if len(next(iter(train.values()))) == 0:
        raise DataError(f"data.name={data_config.name} has no training records; add data or lower data.eval_fraction")
    return train, evaluation
