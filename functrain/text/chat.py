"""Instruction data: a jsonl of chat conversations -> token records whose loss falls on assistant turns only.

Each line is ``{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}, ...]}``.
A conversation is rendered with the model's chat template (from its tokenizer files) and tokenised once; the
``mask`` keeps the tokens of each assistant turn's answer (its content and end-of-turn marker, not the header
the template writes before it) and drops everything else, padding included. The character span of a turn is
where the template, rendered up to that turn, extends the rendering of the turns before it plus the
assistant header; a template that rewrites earlier turns as later ones arrive is refused.

Use it as a data target: ``data.target: functrain.text.chat:chat_dataset`` with
``data.kwargs: {path: FILE.jsonl, tokenizer: DIR, seq_len: N}``. Records are ``seq_len + 1`` tokens (longer
conversations are cut, shorter ones padded).

With ``packing: true`` in ``data.kwargs``, conversations are laid end to end, in file order, into records of
``seq_len + 1`` tokens: a conversation goes into the current record if it fits in what is left of it, else it
starts the next one (the rest is padding). A conversation is never split, so one longer than ``seq_len + 1``
tokens is refused (a DataError naming it). Records then also carry ``segment_ids`` (which conversation, from 1
in each record; the padding is a segment of its own) and ``positions`` (restarting at 0 per conversation), the
fields of a packed token-store batch (:mod:`functrain.data.token_windows`): the models attend only within a
conversation and the loss never predicts one conversation from another, so each conversation's loss is the
one it has alone.
"""

import os
from pathlib import Path
from typing import Any

import numpy as np

from functrain.data.token_windows import packing_fields
from functrain.errors import DataError
from functrain.text.jsonl import jsonl_records

ROLES = ("system", "user", "assistant", "tool")


def read_conversations(path: str | os.PathLike) -> list[list[dict[str, str]]]:
    """The conversations of a chat jsonl file; a malformed line is a DataError naming it."""
    conversations = []
    for where, _, record in jsonl_records(path, "chat", "data.kwargs.path"):
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f'{where} has no "messages" list; write {{"messages": [{{"role": ..., "content": ...}}]}}')
        for message in messages:
            role = message.get("role") if isinstance(message, dict) else None
            if role not in ROLES:
                raise DataError(f"{where} has a message with role {role!r}; use one of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise DataError(f'{where} has a {role} message without a text "content"')
        conversations.append(messages)
    if not conversations:
        raise DataError(f"chat file {str(path)!r} holds no conversations")
    return conversations


def assistant_spans(messages: list[dict[str, str]], tokenizer: Any) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant answers."""

    def render(turns, generation_prompt=False):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    text, spans = render(messages), []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:index], True) if index else "", render(messages[: index + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise DataError(
                "the tokenizer's chat template renders earlier turns differently once later turns "
                "follow; the assistant tokens cannot be located (use a template that appends turns)"
            )
        spans.append((len(before), len(through)))
    return text, spans


def tokenize(messages: list[dict[str, str]], tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """The conversation's token ids (int32) and whether each token belongs to an assistant answer (bool)."""
    text, spans = assistant_spans(messages, tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    in_answer = [any(start <= begin < end for start, end in spans) for begin, _ in encoded["offset_mapping"]]
    return np.asarray(encoded["input_ids"], np.int32), np.asarray(in_answer, bool)


def encode(messages: list[dict[str, str]], tokenizer: Any, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` [seq_len + 1] and ``mask`` [seq_len] (1 where the next token belongs to an assistant answer)."""
    ids, in_answer = (part[: seq_len + 1] for part in tokenize(messages, tokenizer))
    tokens = np.full(seq_len + 1, pad_id, np.int32)
    tokens[: len(ids)] = ids
    mask = np.zeros(seq_len, np.float32)
    mask[: max(0, len(ids) - 1)] = in_answer[1:]  # position t predicts token t + 1
    return tokens, mask


def pack(conversations: list[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    """Tokenised conversations (ids, in-answer flags) packed whole, in order, into records of ``seq_len + 1``
    tokens: ``tokens``, ``segment_ids``, ``positions`` [N, seq_len + 1] and ``mask`` [N, seq_len] (see the
    module docstring). A conversation longer than a record is a DataError naming it."""
    length = seq_len + 1
    padding = lambda size: (np.full(size, pad_id, np.int32), np.zeros(size, bool))  # noqa: E731
    pieces, used = [], 0  # conversations and paddings, the records laid end to end
    for number, (ids, in_answer) in enumerate(conversations, start=1):
        if len(ids) > length:
            raise DataError(
                f"conversation {number} has {len(ids)} tokens, more than data.kwargs.seq_len + 1 = "
                f"{length}, and packing never cuts one; raise seq_len or shorten the conversation"
            )
        if used + len(ids) > length:  # this conversation starts the next record; pad the current one
            pieces += [padding(length - used)] if used < length else []
            used = 0
        pieces.append((ids, in_answer))
        used += len(ids)
    if used < length:
        pieces.append(padding(length - used))
    doc_starts = np.cumsum([0] + [len(ids) for ids, _ in pieces[:-1]])
    stream_ids, stream_answer = zip(*pieces)
    tokens = np.concatenate(stream_ids).reshape(-1, length)
    answer = np.concatenate(stream_answer).reshape(-1, length)
    fields = packing_fields(doc_starts, np.arange(len(tokens), dtype=np.int64) * length, length)
    segments = fields["segment_ids"]
    # Position t predicts token t + 1: learned when that token is an answer's, of the same conversation.
    mask = (answer[:, 1:] & (segments[:, 1:] == segments[:, :-1])).astype(np.float32)
    return {"tokens": tokens, "mask": mask, **fields}


def load_chat_tokenizer(path: str | os.PathLike) -> Any:
    """An HF fast tokenizer with a chat template from a directory; DataError (one line) otherwise."""
    from functrain.text.decode import load_tokenizer

    tokenizer = load_tokenizer(path, "data.kwargs.tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"the tokenizer in {str(path)!r} has no chat template; use the model's tokenizer files "
            f"(tokenizer_config.json with chat_template, or chat_template.jinja)"
        )
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"the tokenizer in {str(path)!r} is not a fast tokenizer (tokenizer.json); chat masking "
            f"needs its character offsets"
        )
    return tokenizer


def chat_dataset(path: str, tokenizer: str, seq_len: int, packing: bool = False) -> dict[str, np.ndarray]:
    """``{"tokens": [N, seq_len + 1], "mask": [N, seq_len]}`` from a chat jsonl file, plus ``segment_ids`` and
    ``positions`` [N, seq_len + 1] with ``packing`` (see the module docstring)."""
    conversations = read_conversations(path)
    chat_tokenizer = load_chat_tokenizer(tokenizer)
    pad_id = chat_tokenizer.pad_token_id if chat_tokenizer.pad_token_id is not None else 0
    if packing:
        try:
            return pack([tokenize(messages, chat_tokenizer) for messages in conversations], seq_len, pad_id)
        except DataError as err:
            raise DataError(f"{Path(path).name}: {err}") from None
    records = [encode(messages, chat_tokenizer, seq_len, pad_id) for messages in conversations]
    return {"tokens": np.stack([tokens for tokens, _ in records]), "mask": np.stack([mask for _, mask in records])}
