"""Preference data: a JSONL of pairs -> token records, tokenised exactly as TRL 1.16's ``DPOTrainer`` does.

Each line is one pair in one of TRL's two formats:

- standard: ``{"prompt": str, "chosen": str, "rejected": str}``. The tokenizer's EOS token is appended to each
  completion as text (unless it already ends with it), ``prompt`` and ``prompt + completion`` are tokenised
  (``tokenizer(text=...)``, special tokens as the tokenizer adds them);
- conversational: ``prompt``, ``chosen`` and ``rejected`` are message lists (``[{"role", "content"}, ...]``);
  ``prompt`` is rendered with the chat template and the generation prompt, ``prompt + completion`` without it.

The completion starts where the tokenised prompt stops being a prefix of both tokenised ``prompt +
completion`` (TRL's ``common_prefix_length``). A record holds ``chosen`` and ``rejected`` (int32 ``[seq_len]``,
padded with the pad id, else the EOS id) and ``chosen_mask`` / ``rejected_mask`` (int8, 1 on completion tokens).
``data.seq_len`` is TRL's ``max_length``: a sequence longer than it is refused unless ``truncation_mode`` is
``keep_start`` (its first ``seq_len`` tokens; a pair whose prompt alone fills ``seq_len`` is dropped, as TRL
drops it) or ``keep_end`` (its last ``seq_len`` tokens).

Without a tokenizer directory the text's UTF-8 bytes are the tokens (vocabulary 256; EOS and padding are
byte 0), as ``data.name: char_text`` feeds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from functrain.errors import DataError
from functrain.text.jsonl import jsonl_records

KEYS = ("prompt", "chosen", "rejected")
TRUNCATION_MODES = ("keep_start", "keep_end")


class ByteTokenizer:
    """UTF-8 bytes as token ids, with byte 0 as EOS and padding (the call form of an HF tokenizer)."""

    eos_token = "\x00"
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}


@dataclass
class PairStats:
    """What tokenising the pairs found: identical pairs (kept, warned about) and pairs dropped by truncation."""

    identical: list[int] = field(default_factory=list)  # line numbers
    dropped: list[int] = field(default_factory=list)

    def notes(self, name: str) -> list[str]:
        """One warning line per finding."""
        notes = []
        if self.identical:
            notes.append(
                f"{name}: {len(self.identical)} pair(s) have identical chosen and rejected completions "
                f"(first at line {self.identical[0]}); they carry no preference (their margin is 0)"
            )
        if self.dropped:
            notes.append(
                f"{name}: {len(self.dropped)} pair(s) dropped because the prompt alone fills data.seq_len "
                f"with truncation_mode=keep_start (first at line {self.dropped[0]}), as TRL drops them"
            )
        return notes


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def read_pairs(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, pair)`` of every line of a preference JSONL file; a malformed pair is a one-line
    DataError naming its line."""
    pairs = []
    for where, number, record in jsonl_records(path, "preference", "data.path"):
        if not isinstance(record, dict):
            raise DataError(f'{where} is not a JSON object; write {{"prompt": ..., "chosen": ..., "rejected": ...}}')
        missing = [key for key in KEYS if key not in record]
        if missing:
            raise DataError(
                f'{where} has no {missing[0]!r}; every pair needs "prompt", "chosen" and '
                f'"rejected" (strings, or message lists)'
            )
        conversational = _is_messages(record["prompt"])
        for key in KEYS:
            value = record[key]
            if not (_is_messages(value) if conversational else isinstance(value, str)):
                kind = "a message list" if conversational else "a string"
                raise DataError(
                    f'{where}: {key!r} is not {kind} like "prompt"; give prompt, chosen and rejected '
                    f"all as strings or all as message lists"
                )
        for key in ("chosen", "rejected"):
            if not record[key] or (conversational and not any(m["content"] for m in record[key])):
                raise DataError(f"{where} has an empty {key!r} completion; give it text or remove the pair")
        pairs.append((number, record))
    if not pairs:
        raise DataError(f"preference file {str(path)!r} holds no pairs")
    return pairs


def common_prefix_length(ids: list[int], other: list[int]) -> int:
    """How many leading tokens two sequences share."""
    length = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        length += 1
    return length


def tokenize_pair(pair: dict[str, Any], tokenizer: Any) -> tuple[list[int], list[int], list[int]]:
    """``(prompt_ids, chosen_ids, rejected_ids)`` of one pair, as TRL's ``DPOTrainer`` tokenises it."""
    if _is_messages(pair["prompt"]):

        def ids(messages, generation_prompt=False):
            rendered = tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, add_generation_prompt=generation_prompt
            )
            return list(rendered["input_ids"])

        prompt = ids(pair["prompt"], True)
        with_chosen, with_rejected = ids(pair["prompt"] + pair["chosen"]), ids(pair["prompt"] + pair["rejected"])
    else:
        eos = tokenizer.eos_token
        chosen, rejected = (text if text.endswith(eos) else text + eos for text in (pair["chosen"], pair["rejected"]))
        prompt = list(tokenizer(text=pair["prompt"])["input_ids"])
        with_chosen = list(tokenizer(text=pair["prompt"] + chosen)["input_ids"])
        with_rejected = list(tokenizer(text=pair["prompt"] + rejected)["input_ids"])
    start = min(common_prefix_length(prompt, with_chosen), common_prefix_length(prompt, with_rejected))
    return prompt[:start], with_chosen[start:], with_rejected[start:]


def _row(
    prompt: list[int], completion: list[int], seq_len: int, truncation_mode: str | None, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and completion mask ``[seq_len]`` of prompt + completion, truncated as TRL's collator does."""
    ids, mask = prompt + completion, [0] * len(prompt) + [1] * len(completion)
    if truncation_mode == "keep_start":
        ids, mask = ids[:seq_len], mask[:seq_len]
    elif truncation_mode == "keep_end":
        ids, mask = ids[-seq_len:], mask[-seq_len:]
    tokens = np.full(seq_len, pad_id, np.int32)
    tokens[: len(ids)] = ids
    completion_mask = np.zeros(seq_len, np.int8)
    completion_mask[: len(mask)] = mask
    return tokens, completion_mask


def load_preference_tokenizer(path: str | os.PathLike | None) -> Any:
    """An HF tokenizer from a directory, or the byte tokenizer (None)."""
    if path is None:
        return ByteTokenizer()
    from functrain.text.decode import load_tokenizer

    return load_tokenizer(path, "data.tokenizer")


def preference_arrays(
    path: str | os.PathLike, tokenizer: Any, seq_len: int, truncation_mode: str | None = None
) -> tuple[dict[str, np.ndarray], PairStats]:
    """The records of a preference file (see the module docstring) and what tokenising them found."""
    if truncation_mode not in (None, *TRUNCATION_MODES):
        raise DataError(f"truncation_mode {truncation_mode!r} is not one of {', '.join(TRUNCATION_MODES)}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    name, stats = Path(path).name, PairStats()
    columns: dict[str, list[np.ndarray]] = {"chosen": [], "rejected": [], "chosen_mask": [], "rejected_mask": []}
    for number, pair in read_pairs(path):
        if _is_messages(pair["prompt"]) and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{name} line {number} is conversational (message lists) and the tokenizer has no chat "
                f"template; set data.tokenizer to the model's tokenizer directory"
            )
        prompt, chosen, rejected = tokenize_pair(pair, tokenizer)
        if chosen == rejected:
            stats.identical.append(number)
        longest = len(prompt) + max(len(chosen), len(rejected))
        if longest > seq_len and truncation_mode is None:
            raise DataError(
                f"{name} line {number}: the pair has {longest} tokens, more than data.seq_len={seq_len}; "
                f"raise data.seq_len or set preference.truncation_mode=keep_start (or keep_end)"
            )
        if truncation_mode == "keep_start" and len(prompt) >= seq_len:
            stats.dropped.append(number)
            continue
        for key, completion in (("chosen", chosen), ("rejected", rejected)):
            tokens, mask = _row(prompt, completion, seq_len, truncation_mode, pad_id)
            columns[key].append(tokens)
            columns[f"{key}_mask"].append(mask)
    if not columns["chosen"]:
        raise DataError(
            f"{name}: every pair was dropped (each prompt fills data.seq_len={seq_len}); raise "
            f"data.seq_len or use truncation_mode=keep_end"
        )
    return {key: np.stack(rows) for key, rows in columns.items()}, stats
