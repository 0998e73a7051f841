"""``build`` a run once, then ``drive`` it: ``fit``. The CLI's ``train`` and research code enter here."""

from __future__ import annotations

import os
from typing import Any, Callable

from functrain.callbacks.base import Callback
from functrain.callbacks.outcome import FitResult
from functrain.config.files import override_list
from functrain.config.load import load_config
from functrain.config.schema import Config, RunSections
from functrain.config.sections import PYTHON_OBJECT
from functrain.report.console import show_run_lines
from functrain.run.build import Run, build_run
from functrain.run.loop import drive
from functrain.run.parts import describe_object


def resolve_config(config: Config | dict | str | os.PathLike, overrides: dict[str, Any]) -> Config:
    """A validated Config from a Config, a dict or a YAML path, with ``{"train.max_steps": 5}`` overrides
    (``train__max_steps=5`` works too, for keyword arguments)."""
    dotted = override_list({key.replace("__", "."): value for key, value in overrides.items()})
    if isinstance(config, RunSections):
        return load_config(base=config.to_dict(), overrides=dotted)
    if isinstance(config, dict):
        return load_config(base=config, overrides=dotted)
    return load_config(config, dotted)


def build(
    config: Config | dict | str | os.PathLike,
    *,
    model: Any = None,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    train_data: Any = None,
    eval_data: Any = None,
    callbacks: list[Callback] | None = None,
    inputs: str | tuple[str, ...] | dict[str, str] | None = None,
    labels: str | None = None,
    transform: Callable | None = None,
    **overrides: Any,
) -> Run:
    """The :class:`Run` that :func:`fit` would drive, built and checked but not started (nothing is written).
    The resolved config records a passed model, data or optimizer as ``python_object``, and ``inputs`` /
    ``labels`` as ``data.fields``."""
    recorded = dict(overrides)
    if inputs is not None:
        recorded["data.fields.inputs"] = inputs if isinstance(inputs, (str, dict)) else list(inputs)
    if labels is not None:
        recorded["data.fields.labels"] = labels
    if model is not None:
        recorded["model"] = {PYTHON_OBJECT: describe_object(model)}
    if train_data is not None:
        recorded["data.name"] = PYTHON_OBJECT
    if optimizer is not None:
        recorded["optimizer.name"] = PYTHON_OBJECT
    return build_run(
        resolve_config(config, recorded),
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        train_data=train_data,
        eval_data=eval_data,
        callbacks=callbacks,
        transform=transform,
    )


def fit(
    config: Config | dict | str | os.PathLike,
    *,
    model: Any = None,
    loss_fn: Callable | None = None,
    optimizer: Any = None,
    train_data: Any = None,
    eval_data: Any = None,
    callbacks: list[Callback] | None = None,
    inputs: str | tuple[str, ...] | dict[str, str] | None = None,
    labels: str | None = None,
    transform: Callable | None = None,
    **overrides: Any,
) -> FitResult:
    """Train as ``config`` says, with any objects given in place of the config's, resuming from the run
    directory when a checkpoint is there: ``drive(build(...))``.

    ``config`` is a :class:`~functrain.config.schema.Config`, a dict or a YAML path; ``overrides`` are dotted keys
    (``fit("configs/mlp_digits.yaml", **{"train.max_steps": 100})`` or ``train__max_steps=100``).

    Args:
      model: a Flax linen module, an NNX module, ``FunctionalModel(init, apply)`` (or with ``backend: torch``
        an ``nn.Module``) in place of ``model.name`` / ``model.target``.
      loss_fn: ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)`` (sums, see
        :mod:`functrain.core.step`) in place of the built-in loss for the data's fields; with a model that
        has mutable state (BatchNorm), ``loss_fn(params, batch, rng, model_state) -> (..., new_model_state)``,
        called with ``rng=None`` in evaluation (run the model in inference mode then; see
        :mod:`functrain.core.program`).
      optimizer: an ``optax.GradientTransformation``, or a function of the config's schedule returning one.
      train_data, eval_data: a dict of arrays or memmaps, an HF ``datasets.Dataset``, a torch ``Dataset``,
        a Grain data source or ``MapDataset``, or a :class:`~functrain.data.Source`.
      callbacks: extra :class:`~functrain.callbacks.base.Callback` objects.
      inputs, labels: the field the model is called on (``{"pixel_values": "image"}``: by keyword) and the
        one the built-in loss reads as labels, for data outside the conventions of :mod:`functrain.core.fields`
        (``data.fields`` in the config; these win).
      transform: ``transform(record, rng) -> record`` applied to every training and evaluation record as it
        is read (map-style data; ``data.transform`` in the config), to reshape records without a data source.

    It prints what ``functrain train`` prints (the run directory at the start, warnings, the summary at the end)
    on stderr, unless the program configured logging itself (:mod:`functrain.report.console`); ``print(fit(...))``
    is one line.
    """
    show_run_lines()
    return drive(
        build(
            config,
            model=model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            train_data=train_data,
            eval_data=eval_data,
            callbacks=callbacks,
            inputs=inputs,
            labels=labels,
            transform=transform,
            **overrides,
        )
    )
