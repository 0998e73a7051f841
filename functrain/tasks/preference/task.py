"""The preference task: pairs tokenised from ``data.path``, TRL's losses against a reference, and the
precomputed reference's start hook."""

from __future__ import annotations

from typing import Any

import numpy as np

from functrain.core.adapters import ModelPieces
from functrain.core.program import Program
from functrain.data import as_source
from functrain.data.datasets import split_records
from functrain.data.validate import BatchCheck, FieldRule
from functrain.errors import ConfigError, DataError
from functrain.tasks.base import StartHook, Task, TaskContext, TaskData
from functrain.tasks.chunked_logits import chunked_pieces
from functrain.tasks.preference.loss import (
    REFERENCE_LOGPS,
    PreferenceSettings,
    precomputed_reference_logps,
    preference_program,
)


def settings_of(section: Any) -> PreferenceSettings:
    """The ``preference.*`` loss settings."""
    return PreferenceSettings(section.loss_type, section.beta, section.label_smoothing, section.simpo_gamma)


def with_reference_fields(example_batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``example_batch`` with the fields the batches of a precomputed run carry (zeros: the step is built for
    their shapes only)."""
    rows = len(example_batch["chosen"])
    return {**example_batch, **{name: np.zeros(rows, np.float32) for name in REFERENCE_LOGPS}}


class Preference(Task):
    """Pairs of completions, the preferred one first, trained with TRL's preference losses."""

    name = "preference"

    def check(self, context: TaskContext) -> None:
        if context.config.backend not in self.backends:
            raise ConfigError(
                f"data.name=preference (DPO and its variants) needs backend: {' or '.join(self.backends)}; "
                f"set backend={self.backends[0]}"
            )
        if context.loss_fn is not None:
            raise ConfigError(
                "data.name=preference trains with the preference loss (preference.loss_type); remove "
                "loss_fn= or use other data"
            )

    def data(self, context: TaskContext) -> TaskData:
        """The pairs of ``data.path`` tokenised with ``data.tokenizer`` (UTF-8 bytes when unset), split by
        ``data.eval_fraction``; with ``precompute_ref`` the reference's log-probs join them at the start."""
        from functrain.tasks.preference.pairs import load_preference_tokenizer, preference_arrays

        config, section = context.config, context.config.section(self.name)
        data = config.data
        if context.data_given:
            raise ConfigError("task preference reads its pairs from data.path; remove train_data= or use another task")
        if section.precompute_ref and not settings_of(section).uses_reference:
            raise ConfigError(
                f"preference.precompute_ref precomputes the reference's log-probs and "
                f"loss_type={section.loss_type} uses no reference; remove preference.precompute_ref"
            )
        if not data.path:
            raise ConfigError(
                "data.name=preference needs data.path; set data.path=PAIRS.jsonl (prompt, chosen, rejected per line)"
            )
        arrays, stats = preference_arrays(
            data.path, load_preference_tokenizer(data.tokenizer), data.seq_len, section.truncation_mode
        )
        train, evaluation = split_records(arrays, data.eval_fraction)
        if not len(train["chosen"]):
            raise DataError(f"{data.path} has no training pairs; add pairs or lower data.eval_fraction")
        vocab = config.model.vocabulary_size()
        check = BatchCheck(
            [
                FieldRule(name, upper=vocab, bound_key="model.vocab_size", what="token id")
                for name in ("chosen", "rejected")
            ],
            source=f"the data ({data.path})",
        )
        eval_source = as_source(evaluation) if len(evaluation["chosen"]) else None
        train_source = as_source(train)
        notes = tuple(stats.notes(data.path))
        if section.precompute_ref:  # the loaders read the pairs with columns the start hook fills
            from functrain.data.computed_columns import ComputedColumns

            return TaskData(
                train=train_source,
                eval=eval_source,
                batch_check=check,
                notes=notes,
                example_fields=with_reference_fields,
                loader_train=ComputedColumns(train_source, REFERENCE_LOGPS),
                loader_eval=None if eval_source is None else ComputedColumns(eval_source, REFERENCE_LOGPS),
            )
        return TaskData(train=train_source, eval=eval_source, batch_check=check, notes=notes)

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        """A causal LM called on the pairs' tokens but the last."""
        return np.asarray(example_batch["chosen"])[:, :-1]

    def program(
        self, context: TaskContext, data: TaskData, pieces: ModelPieces, example_batch: dict[str, np.ndarray]
    ) -> Program:
        """The preference loss on the model's pieces; the reference is the frozen base when a transform froze one
        (LoRA), else a frozen copy of the starting weights, or the log-probs the batches carry."""
        section = context.config.section(self.name)
        return program_on_pieces(
            chunked_pieces(pieces, context.config.train.logits_chunk),
            settings_of(section),
            precompute_ref=section.precompute_ref,
        )

    def start_hooks(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> list[StartHook]:
        """``preference.precompute_ref``: the reference's log-probs of every pair, computed (or read back) once
        the start is known."""
        if not context.config.section(self.name).precompute_ref:
            return []
        from functrain.data.computed_columns import ComputedColumns
        from functrain.tasks.preference.reference import PrecomputedReference

        config = context.config
        pieces = chunked_pieces(pieces, config.train.logits_chunk)
        # data() gave the loaders the pairs wrapped as ComputedColumns, which this hook fills.
        columns = {
            split: loader if isinstance(loader, ComputedColumns) else None
            for split, loader in (("train", data.loader_train), ("eval", data.loader_eval))
        }
        sources = {split: None if wrapped is None else wrapped.source for split, wrapped in columns.items()}
        return [
            PrecomputedReference(
                context.run_dir,
                sources,
                columns,
                config.data.global_batch_size,
                config.train.compute_dtype,
                precomputed_reference_logps(pieces.apply, pieces.frozen_apply),
            )
        ]


def program_on_pieces(pieces: ModelPieces, settings: PreferenceSettings, *, precompute_ref: bool = False) -> Program:
    """The preference loss on a causal LM's pieces (see :func:`functrain.tasks.preference.loss.preference_program`)."""
    if pieces.framework == "functions":
        raise ConfigError(
            "data.name=preference trains a causal LM given as a Flax linen or NNX module; pass one "
            "of those, or a registry model (model.name)"
        )
    return preference_program(pieces, settings, precompute_reference=precompute_ref)


def preference_pieces(model: Any, example_batch: dict[str, np.ndarray], lora: Any = None) -> ModelPieces:
    """A causal LM's pieces as a preference run builds them (``lora``: a ``model.lora`` section, or None)."""
    from functrain.core.adapters import model_pieces
    from functrain.models.lora import lora_transform

    pieces = model_pieces(model, np.asarray(example_batch["chosen"])[:, :-1], example_batch)
    return pieces if lora is None else lora_transform(pieces, lora)


def preference_program_of(
    model: Any,
    example_batch: dict[str, np.ndarray],
    settings: PreferenceSettings,
    lora: Any = None,
    *,
    precompute_ref: bool = False,
) -> Program:
    """The Program of ``model`` (with LoRA adapters, whose base is the reference) trained on preference pairs
    like ``example_batch`` (research code's entry; runs build it through the task)."""
    return program_on_pieces(preference_pieces(model, example_batch, lora), settings, precompute_ref=precompute_ref)


TASKS = {"preference": Preference()}
