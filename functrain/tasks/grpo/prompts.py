"""The prompts of a GRPO run: a JSONL file, one prompt per line, read and tokenised as TRL 1.16's ``GRPOTrainer``
reads a prompt dataset.

Each line is a JSON object with ``prompt`` (a string, or a list of ``{"role", "content"}`` messages rendered with the
tokenizer's chat template and its generation prompt) and any other columns, which reach the reward functions by
name. Without a tokenizer directory the prompt's UTF-8 bytes are its tokens (EOS and padding are byte 0), as the
byte-level models of ``data.name: char_text`` read them.

The prompts live on the host: the loader's batches carry only their indices (``prompt_index``), and the task's
experience stage looks the rows up to sample completions and hand the reward functions their columns.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from functrain.errors import DataError
from functrain.text.decode import decode_tokens
from functrain.text.jsonl import jsonl_records

PROMPT = "prompt"
PROMPT_INDEX = "prompt_index"  # the loader's only field


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


@dataclass(frozen=True)
class Prompts:
    """Every prompt of the file: ``rows`` (the JSON objects as written), ``ids`` (token ids of each prompt, as the
    model reads it), whether they are ``conversational`` (message lists), the ``tokenizer`` (None: UTF-8 bytes)
    and the ids that end a completion (``eos_ids``) or pad a row (``pad_id``)."""

    rows: list[dict[str, Any]]
    ids: list[np.ndarray]
    conversational: bool
    tokenizer: Any
    eos_ids: tuple[int, ...]
    pad_id: int
    path: str

    @functools.cached_property
    def longest(self) -> int:
        """Tokens of the longest prompt (read at every step: counted once)."""
        return max(len(ids) for ids in self.ids)

    @functools.cached_property
    def shortest(self) -> int:
        """Tokens of the shortest prompt."""
        return min(len(ids) for ids in self.ids)

    def columns(self, indices: np.ndarray) -> dict[str, list[Any]]:
        """The rows' columns other than ``prompt`` as TRL passes them to a reward function: ``{name: [value per
        row]}`` (None where a row lacks one)."""
        names = sorted({name for index in indices for name in self.rows[index] if name != PROMPT})
        return {name: [self.rows[index].get(name) for index in indices] for name in names}

    def text(self, index: int) -> str:
        """Prompt ``index`` as the model reads it (a conversation rendered by the chat template)."""
        ids = self.ids[index]
        return decode_tokens(ids) if self.tokenizer is None else self.tokenizer.decode(ids.tolist())

    def texts(self, completion_ids: list[np.ndarray]) -> list[str]:
        """The text of each token sequence, without special tokens (EOS)."""
        if self.tokenizer is None:
            return [decode_tokens(ids[~np.isin(ids, self.eos_ids)]) for ids in completion_ids]
        return list(self.tokenizer.batch_decode([ids.tolist() for ids in completion_ids], skip_special_tokens=True))

    def decode(self, completion_ids: list[np.ndarray]) -> list[Any]:
        """The completions as TRL hands them to a reward function: text without special tokens, or for
        conversational prompts ``[{"role": "assistant", "content": text}]``."""
        texts = self.texts(completion_ids)
        if self.conversational:
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def encode(self, text: str) -> np.ndarray:
        """The token ids of ``text`` as it follows other tokens (an environment's): UTF-8 bytes, or the tokenizer's
        ids without the special tokens it adds to a whole input."""
        if self.tokenizer is None:
            return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        return np.asarray(self.tokenizer(text=text, add_special_tokens=False)["input_ids"], np.int32)


@dataclass(frozen=True)
class PromptSource:
    """The loader's view of the prompts: record ``i`` is ``{"prompt_index": i}`` (the rows stay on the host, with
    the experience stage)."""

    prompts: Prompts

    def __len__(self) -> int:
        return len(self.prompts.rows)

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The records at ``indices``."""
        return {PROMPT_INDEX: np.asarray(indices, np.int32)}


def _tokenize(prompt: Any, tokenizer: Any) -> list[int]:
    if tokenizer is None:
        return list(prompt.encode("utf-8"))
    if isinstance(prompt, list):
        rendered = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
        return list(rendered["input_ids"])
    return list(tokenizer(text=prompt)["input_ids"])


def _end_ids(tokenizer: Any) -> tuple[tuple[int, ...], int]:
    """``(eos ids, pad id)``: byte 0 for both without a tokenizer; else the tokenizer's EOS (TRL's) and its pad
    token, or EOS when it has none (as TRL sets it)."""
    if tokenizer is None:
        return (0,), 0
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer of data.tokenizer has no EOS token; a completion could never end")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return (int(tokenizer.eos_token_id),), int(pad)


def read_prompts(path: str | os.PathLike, tokenizer: Any) -> Prompts:
    """The prompts of the JSONL file at ``path`` tokenised with ``tokenizer`` (None: UTF-8 bytes); a malformed
    line is a one-line DataError naming it."""
    name = Path(path).name
    rows, ids, kinds = [], [], set()
    for where, _, record in jsonl_records(path, "prompts", "data.path"):
        if not isinstance(record, dict) or PROMPT not in record:
            raise DataError(f'{where} has no "prompt"; write {{"prompt": "...", ...}} (other keys are columns)')
        prompt = record[PROMPT]
        conversational = _is_messages(prompt)
        if not conversational and not isinstance(prompt, str):
            raise DataError(f'{where}: "prompt" is neither a string nor a list of {{"role", "content"}} messages')
        if conversational and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
            raise DataError(
                f"{where} is conversational (a message list) and the tokenizer has no chat template; set "
                f"data.tokenizer to the model's tokenizer directory"
            )
        kinds.add(conversational)
        if len(kinds) > 1:
            raise DataError(f"{where} mixes strings and message lists as prompts; give every prompt in one form")
        tokens = _tokenize(prompt, tokenizer)
        if not tokens:
            raise DataError(f"{where} has an empty prompt; give it text or remove the line")
        rows.append(record)
        ids.append(np.asarray(tokens, np.int32))
    if not rows:
        raise DataError(f"prompts file {str(path)!r} holds no prompts; write one JSON object per line")
    eos_ids, pad_id = _end_ids(tokenizer)
    return Prompts(rows, ids, kinds.pop(), tokenizer, eos_ids, pad_id, name)
