"""The model's forwards handing a task's loss the head unapplied (``train.logits_chunk``), so that log-probs are
formed over chunks of positions and the ``[tokens, vocab]`` logits never exist whole
(:mod:`functrain.core.unembedding`): shared by every task that scores tokens (preference, GRPO)."""

from __future__ import annotations

import dataclasses
import functools

from functrain.core.adapters import Apply, ModelPieces
from functrain.core.unembedding import LOGITS_CHUNK, LogitsChunk


def with_logits_chunk(apply: Apply, logits_chunk: LogitsChunk) -> Apply:
    """``apply`` asking the model for its head unapplied unless ``logits_chunk`` is ``off``; a model that does not
    take the setting gives its logits."""
    if logits_chunk == "off":
        return apply
    return functools.partial(apply, **{LOGITS_CHUNK: logits_chunk})


def chunked_pieces(pieces: ModelPieces, logits_chunk: LogitsChunk) -> ModelPieces:
    """``pieces`` whose forwards (the trained one and the frozen reference's) hand the loss their head unapplied."""
    frozen = pieces.frozen_apply
    return dataclasses.replace(
        pieces,
        apply=with_logits_chunk(pieces.apply, logits_chunk),
        frozen_apply=None if frozen is None else with_logits_chunk(frozen, logits_chunk),
    )
