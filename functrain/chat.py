"""Instruction data: a jsonl of chat conversations -> token records whose loss falls on assistant turns only.

Each line is ``{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}``.
A conversation is rendered with the model's chat template (from its tokenizer files) and tokenised once; the
``mask`` keeps the tokens of each assistant turn's answer (its content and end-of-turn marker, not the header
the template writes before it) and drops everything else, padding included. The character span of a turn is
where the template, rendered up to that turn, extends the rendering of the turns before it plus the
assistant header; a template that rewrites earlier turns as later ones arrive is refused.

Use it as a data target: ``data.target: functrain.chat:chat_dataset`` with
``data.kwargs: {path: FILE.jsonl, tokenizer: DIR, seq_len: N}``. Records are ``seq_len + 1`` tokens (longer
conversations are cut, shorter ones padded).
"""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from functrain.errors import DataError

ROLES = ("system", "user", "assistant", "tool")


def read_conversations(path: str | os.PathLike) -> list[list[dict[str, str]]]:
    """The conversations of a chat jsonl file; a malformed line is a DataError naming it."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"chat file {str(file)!r} does not exist; fix data.kwargs.path")
    conversations = []
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{file.name} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where} is not JSON ({err.msg}); write one JSON object per line") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where} has no \"messages\" list; write {{\"messages\": [{{\"role\": ..., "
                            f"\"content\": ...}}]}}")
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise DataError(f"{where} has a message with role {role!r}; use one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise DataError(f"{where} has a {role} message without a text \"content\"")
        conversations.append(messages)
    if not conversations:
        raise DataError(f"chat file {str(file)!r} holds no conversations")
    return conversations


def assistant_spans(messages: list[dict[str, str]], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant answers."""
    def render(turns, generation_prompt=False):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    text, spans = render(messages), []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], True) if index else "", render(messages[:index + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError("the tokenizer's chat template renders earlier turns differently once later turns "
                            "follow; the assistant tokens cannot be located (use a template that appends turns)")
        spans.append((len(before), len(through)))
    return text, spans


def encode(messages: list[dict[str, str]], tokenizer: Any, seq_len: int, pad_id: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` [seq_len + 1] and ``mask`` [seq_len] (1 where the next token belongs to an assistant answer)."""
    text, spans = assistant_spans(messages, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"][:seq_len + 1], encoded["offset_mapping"][:seq_len + 1]
    in_answer = [any(start <= begin < end for start, end in spans) for begin, _ in offsets]
    tokens = np.full(seq_len + 1, pad_id, np.int32)
    tokens[:len(ids)] = ids
    mask = np.zeros(seq_len, np.float32)
    mask[:max(0, len(ids) - 1)] = in_answer[1:]  # position t predicts token t + 1
    return tokens, mask


def load_chat_tokenizer(path: str | os.PathLike) -> Any:
    """An HF fast tokenizer with a chat template from a directory; DataError (one line) otherwise."""
    from functrain.generate import load_tokenizer

    tokenizer = load_tokenizer(path)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the tokenizer in {str(path)!r} has no chat template; use the model's tokenizer files "
                        f"(tokenizer_config.json with chat_template, or chat_template.jinja)")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"the tokenizer in {str(path)!r} is not a fast tokenizer (tokenizer.json); chat masking "
                        f"needs its character offsets")
    return tokenizer


def chat_dataset(path: str, tokenizer: str, seq_len: int) -> dict[str, np.ndarray]:
    """``{"tokens": [N, seq_len + 1], "mask": [N, seq_len]}`` from a chat jsonl file (see the module docstring)."""
    conversations = read_conversations(path)
    chat_tokenizer = load_chat_tokenizer(tokenizer)
    pad_id = chat_tokenizer.pad_token_id if chat_tokenizer.pad_token_id is not None else 0
    records = [encode(messages, chat_tokenizer, seq_len, pad_id) for messages in conversations]
    return {"tokens": np.stack([tokens for tokens, _ in records]), "mask": np.stack([mask for _, mask in records])}
