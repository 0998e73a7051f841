"""Tokenizers for ``functrain tokenize``: an HF ``tokenizers`` file or directory, or UTF-8 bytes.

- A ``tokenizer.json`` of the HF ``tokenizers`` library, or a ``transformers`` tokenizer directory holding one
  (its ``tokenizer_config.json`` names the EOS token). Needs the ``lm`` extra (``pip install 'functrain[lm]'``).
  Encoding keeps the tokenizer's own post-processing (e.g. a BOS token), as ``tokenizer.encode`` would.
- Without a file, the byte fallback: a document's tokens are its UTF-8 bytes (vocab 256, what
  ``data.name: char_text`` and ``functrain generate`` without ``--tokenizer`` use).

End of document: every document is followed by the tokenizer's EOS id so that a model trained on unpacked
windows learns where documents end. A ``transformers`` directory's EOS is its ``eos_token``; a bare
``tokenizer.json``'s is the first of its special tokens named in :data:`EOS_NAMES`; a tokenizer with none
appends nothing (the store's document index still records the boundaries). The byte fallback's EOS is byte 0
(NUL), which UTF-8 text does not contain.

A tokenizer is named by a picklable :class:`TokenizerSpec` so that worker processes can load their own copy.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from functrain.errors import ConfigError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")
BYTE_EOS = 0


@dataclass(frozen=True)
class TokenizerSpec:
    """Where a tokenizer comes from: ``file`` is a ``tokenizer.json`` path, or None for the byte fallback."""

    file: str | None = None
    eos_token: str | None = None  # from a transformers directory's tokenizer_config.json


def tokenizer_spec(path: str | os.PathLike | None) -> TokenizerSpec:
    """The spec of ``--tokenizer PATH`` (a tokenizer.json or a directory holding one; None: bytes)."""
    if path is None:
        return TokenizerSpec()
    path = Path(path)
    if path.is_dir():
        config_path = path / "tokenizer_config.json"
        try:
            eos = json.loads(config_path.read_text()).get("eos_token") if config_path.is_file() else None
        except (OSError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{config_path} is not a readable tokenizer config ({exc}); fix or remove it") from None
        if isinstance(eos, dict):  # older transformers write {"content": "</s>", ...}
            eos = eos.get("content")
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(
                f"--tokenizer directory {str(path.parent)!r} has no tokenizer.json; pass a "
                f"transformers tokenizer directory saved with a fast tokenizer, or a tokenizer.json"
            )
        return TokenizerSpec(str(path), eos)
    if not path.is_file():
        raise ConfigError(
            f"--tokenizer {str(path)!r} does not exist; pass a tokenizer.json or a transformers "
            f"tokenizer directory, or leave it out for UTF-8 bytes"
        )
    return TokenizerSpec(str(path))


class TextTokenizer:
    """Encodes documents to arrays of token ids, each followed by the EOS id (if any)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._hf = _load_hf(spec.file) if spec.file else None
        self.eos_id: int | None  # None: the tokenizer has no end-of-document token
        if self._hf is None:
            self.vocab_size, self.eos_id = 256, BYTE_EOS
        else:
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            self.eos_id = _eos_id(self._hf, spec.eos_token)

    def describe(self) -> dict[str, Any]:
        """What the store's manifest records about this tokenizer."""
        if self.spec.file is None:
            return {"name": "bytes", "xxh64": None, "eos_id": self.eos_id}
        path = Path(self.spec.file)
        name = path.parent.name if path.name == "tokenizer.json" and path.parent.name else path.name
        return {"name": name, "xxh64": xxhash.xxh64(path.read_bytes()).hexdigest(), "eos_id": self.eos_id}

    def encode_batch(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """The texts' token ids end to end, each followed by EOS, and each text's token count (EOS included):
        one flat array rather than one per document, so handing a batch between processes stays cheap."""
        eos = [] if self.eos_id is None else [self.eos_id]
        if self._hf is None:
            encoded = [text.encode("utf-8") + bytes(eos) for text in texts]
            return np.frombuffer(b"".join(encoded), np.uint8), np.array([len(item) for item in encoded], np.int64)
        ids = [encoding.ids for encoding in self._hf.encode_batch_fast(texts)]
        lengths = np.array([len(item) + len(eos) for item in ids], np.int64)
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable((item, eos) for item in ids))
        return np.fromiter(flat, np.int64, count=int(lengths.sum())), lengths


def _load_hf(file: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("--tokenizer needs the HF tokenizers library; pip install 'functrain[lm]'") from None
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # noqa: BLE001 -- the Rust side raises plain Exception subclasses for any malformed file
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"tokenizer file {file!r} does not load ({reason}); pass a tokenizer.json written by "
            f"HF tokenizers (Tokenizer.save) or a transformers tokenizer directory"
        ) from None


def _eos_id(tokenizer: Any, eos_token: str | None) -> int | None:
    if eos_token is not None:
        return tokenizer.token_to_id(eos_token)
    special = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    return next((tokenizer.token_to_id(name) for name in EOS_NAMES if name in special), None)
