"""functrain: a pure-functional training library for JAX/Flax.

The public surface: :class:`TrainState`, :func:`make_train_step`, :func:`make_eval_step`,
:func:`make_train_call`; :func:`fit` = :func:`drive` (:func:`build` (config, objects)), the built :class:`Run`
and its :class:`FitResult`; the model wrappers :class:`FunctionalModel` / :class:`Program`; data order in
:mod:`functrain.data`, checkpoints in :mod:`functrain.checkpoint`. ``import functrain`` never imports torch.

The names load on first use (PEP 562), so ``import functrain`` and the command line start without importing
JAX: ``functrain train`` takes SIGTERM from its first instant (a preempted VM may send it while JAX imports).
"""

import importlib
from typing import Any

from functrain.parallel.platform import choose_platforms

choose_platforms()  # before jax is imported: no libtpu start-up on machines without a TPU

# Public name -> the module that defines it.
_PUBLIC = {
    "TrainState": "functrain.core.state",
    "make_eval_step": "functrain.core.step",
    "make_train_call": "functrain.core.step",
    "make_train_step": "functrain.core.step",
    "FunctionalModel": "functrain.core.adapters",
    "Program": "functrain.core.program",
    "Run": "functrain.run.build",
    "build": "functrain.run.fit",
    "fit": "functrain.run.fit",
    "drive": "functrain.run.loop",
    "FitResult": "functrain.callbacks.outcome",
    "StopKind": "functrain.callbacks.outcome",
}

__all__ = sorted(_PUBLIC)  # noqa: PLE0605 -- the names __getattr__ imports on first use
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'functrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
