"""Which batch fields the model and the built-in loss read: the conventions users bring, or an explicit map.

Recognised without configuration (:func:`resolve_fields`):

- a classifier: one input field of ``x`` / ``image`` / ``inputs`` / ``pixel_values`` with labels ``y`` /
  ``label`` / ``labels`` of shape ``[batch]`` (the Flax/TFDS and HF image conventions);
- a causal LM on ``tokens`` ``[batch, L + 1]``: the model reads ``tokens[:, :-1]`` and predicts
  ``tokens[:, 1:]`` (shift inside; optional ``mask``, ``segment_ids``, ``positions``);
- a causal LM on HF fields: ``input_ids`` with optional ``labels`` (same length; logits at ``i`` predict
  ``labels[i + 1]``; ``-100`` is not counted; without ``labels`` the ids are their own labels) and optional
  ``attention_mask`` (0 = padding: not counted, and masked as a key for models whose call takes
  ``attention_mask``, or ``segment_ids`` as functrain's models do; see :mod:`functrain.core.program`).

``labels`` next to ``input_ids`` is an LM's; next to an image-like input a classifier's. Two candidate fields
for one role are refused in one line naming both. Anything else is named by an explicit map
(``inputs="image", labels="target"``: ``data.fields`` in the config, ``fit(..., inputs=, labels=)``; a
one-entry mapping ``inputs={"pixel_values": "image"}`` passes the field by keyword); the
built-in loss then follows the labels' shape (``[batch]``: classifier; the input's ``[batch, L]``: causal LM).

:func:`canonical` gives the built-in losses (:mod:`functrain.core.losses`) the batch under the names they
read (``x``/``y``, or ``tokens`` with ``labels``/``attention_mask``); the arrays are the same, only the keys
change, so user losses keep reading the data's own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from functrain.errors import DataError

CLASSIFIER_INPUTS = ("x", "image", "inputs", "pixel_values")
CLASSIFIER_LABELS = ("y", "label", "labels")
# Per-token fields a ``tokens`` batch may carry next to its tokens.
TOKEN_EXTRAS = ("mask", "segment_ids", "positions")
INPUTS_FIX = "set data.fields.inputs or pass fit(..., inputs=...)"
LABELS_FIX = "set data.fields.labels or pass fit(..., labels=...)"


@dataclass(frozen=True)
class Fields:
    """The roles of a batch's fields.

    Attributes:
      kind: the built-in loss (``classifier`` / ``causal_lm``), or None when no built-in loss fits (a user
        ``loss_fn`` then reads the batch; ``inputs`` still says what a linen model is initialised on).
      inputs: the field the model is called on.
      argument: the keyword the model takes ``inputs`` under; None: positionally.
      labels: a classifier's labels; an LM's HF ``labels`` (None: the inputs shifted).
      attention_mask: an LM's HF ``attention_mask`` field, or None.
      hf: an LM on HF fields (same-length labels) rather than ``tokens`` of length L + 1.
    """

    kind: str | None
    inputs: str
    labels: str | None = None
    attention_mask: str | None = None
    hf: bool = False
    argument: str | None = None


def _names(batch: Mapping[str, Any]) -> list[str]:
    return sorted(name for name in batch if name != "weight")


def _one_of(batch: Mapping[str, Any], candidates: Sequence[str], role: str, fix: str) -> str | None:
    present = [name for name in candidates if name in batch]
    if len(present) > 1:
        raise DataError(
            f"the data has {' and '.join(repr(name) for name in present)}, both candidate {role} "
            f"fields; name the one to use: {fix}"
        )
    return present[0] if present else None


def _lm(batch: Mapping[str, Any], inputs: str, labels: str | None) -> Fields:
    mask = "attention_mask" if "attention_mask" in batch else None
    return Fields("causal_lm", inputs, labels, mask, hf=inputs != "tokens" or labels is not None)


def _by_shape(batch: Mapping[str, Any], inputs: str, labels: str | None) -> Fields:
    """The built-in loss an explicit map calls for, from the shapes of its fields."""
    data, target = np.asarray(batch[inputs]), None if labels is None else np.asarray(batch[labels])
    token_like = data.ndim == 2 and np.issubdtype(data.dtype, np.integer)
    if target is None:
        return _lm(batch, inputs, None) if token_like else Fields(None, inputs)
    if target.ndim == 1:
        return Fields("classifier", inputs, labels)
    if token_like and target.shape == data.shape:
        return _lm(batch, inputs, labels)
    raise DataError(
        f"labels field {labels!r} has shape {list(target.shape[1:])} per record, which fits no built-in "
        f"loss (classifier: one integer per record; causal LM: one per token of {inputs!r}, shape "
        f"{list(data.shape[1:])}); {LABELS_FIX} to a field that does, or pass loss_fn="
    )


def _check_named(batch: Mapping[str, Any], name: str, key: str) -> None:
    if name not in batch:
        raise DataError(
            f"data.fields.{key} names {name!r}, which the data does not have (fields: {_names(batch)}); "
            f"set data.fields.{key} or pass fit(..., {key}=...) to one of them"
        )


def resolve_fields(
    batch: Mapping[str, Any],
    *,
    inputs: str | Sequence[str] | Mapping[str, str] | None = None,
    labels: str | None = None,
    kind: str | None = None,
) -> Fields | None:
    """The roles of ``batch``'s fields (any number of records): the explicit map where given, the conventions
    (module docstring) for the rest; None when the data names no model input at all.

    ``kind`` (a registry model's or ``model.kind``) wins over the kind the fields call for. Raises a one-line
    DataError for a map naming a missing field, two candidate fields for one role, or labels of a shape that
    fits no built-in loss.
    """
    argument = None
    if inputs is not None and not isinstance(inputs, str):
        if len(inputs) != 1:
            raise DataError(
                f"data.fields.inputs names {list(inputs)}; the built-in losses call the model on one "
                f"input field: name one, and read the others in loss_fn="
            )
        if isinstance(inputs, Mapping):
            ((argument, inputs),) = inputs.items()
        else:
            inputs = inputs[0]
    fields = _resolve(batch, inputs, labels, kind)
    return fields if fields is None or argument is None else replace(fields, argument=argument)


def _resolve(batch: Mapping[str, Any], inputs: str | None, labels: str | None, kind: str | None) -> Fields | None:
    """:func:`resolve_fields` for one input field name (or None: the conventions)."""
    for name, key in ((inputs, "inputs"), (labels, "labels")):
        if name is not None:
            _check_named(batch, name, key)
    explicit = inputs is not None
    if inputs is None:
        inputs = next((name for name in ("tokens", "input_ids") if name in batch), None) or _one_of(
            batch, CLASSIFIER_INPUTS, "input", INPUTS_FIX
        )
        if inputs is None:
            return None
    if labels is None and inputs == "input_ids":
        labels = "labels" if "labels" in batch else None
    elif labels is None and inputs != "tokens":
        labels = _one_of(batch, CLASSIFIER_LABELS, "label", LABELS_FIX)
        if labels is None and not explicit:  # an image without labels: no built-in loss (a named input may be an LM's)
            return Fields(None, inputs)
    fields = _by_shape(batch, inputs, labels)
    if kind is not None and kind != fields.kind:
        if kind == "causal_lm":
            return _lm(batch, inputs, labels)
        if labels is None:
            raise DataError(
                f"the {kind} loss needs labels and the data has no label field among {_names(batch)}; {LABELS_FIX}"
            )
        return Fields(kind, inputs, labels)
    return fields


def require_builtin(fields: Fields | None, batch: Mapping[str, Any]) -> Fields:
    """``fields`` when a built-in loss fits them; otherwise a one-line DataError saying which role is missing,
    the fields present and the setting that fixes it."""
    if fields is None:
        raise DataError(
            f"no model input among the data's fields {_names(batch)} (looked for "
            f"{'/'.join(CLASSIFIER_INPUTS)}, tokens, input_ids); {INPUTS_FIX}, or wrap the model as "
            f"FunctionalModel(init, apply) with loss_fn="
        )
    if fields.kind is None:
        raise DataError(
            f"no labels for input {fields.inputs!r} among the data's fields {_names(batch)} (looked for "
            f"{'/'.join(CLASSIFIER_LABELS)}); {LABELS_FIX}, or pass loss_fn="
        )
    return fields


def canonical(fields: Fields, batch: Mapping[str, Any]) -> dict[str, Any]:
    """``batch`` under the names the built-in losses read (the same arrays): ``x``, ``y`` for a classifier;
    ``tokens`` with ``mask``/``segment_ids``/``positions`` or with HF ``labels``/``attention_mask`` for an LM."""
    out = {"weight": batch["weight"]}
    if fields.kind == "classifier":
        assert fields.labels is not None, "a classifier's fields name its labels"
        return {**out, "x": batch[fields.inputs], "y": batch[fields.labels]}
    out["tokens"] = batch[fields.inputs]
    if not fields.hf:
        return {**out, **{name: batch[name] for name in TOKEN_EXTRAS if name in batch}}
    if fields.labels is not None:
        out["labels"] = batch[fields.labels]
    if fields.attention_mask is not None:
        out["attention_mask"] = batch[fields.attention_mask]
    return out
