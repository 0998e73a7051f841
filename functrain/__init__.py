"""functrain: a pure-functional training library for JAX/Flax.

The public surface: :class:`TrainState`, :func:`make_train_step`, :func:`make_eval_step`,
:func:`make_train_call`; :func:`fit` = :func:`drive` (:func:`build` (config, objects)), the built :class:`Run`
and its :class:`FitResult`; the model wrappers :class:`FunctionalModel` / :class:`Program`; data order in
:mod:`functrain.data`, checkpoints in :mod:`functrain.checkpoint`. ``import functrain`` never imports torch.
"""

from functrain.parallel.platform import choose_platforms

choose_platforms()  # before jax is imported: no libtpu start-up on machines without a TPU

from functrain.core.state import TrainState  # noqa: E402
from functrain.core.step import make_eval_step, make_train_call, make_train_step  # noqa: E402
from functrain.core.program import FunctionalModel, Program  # noqa: E402
from functrain.run.build import Run  # noqa: E402
from functrain.run.fit import build, fit  # noqa: E402
from functrain.run.loop import drive  # noqa: E402
from functrain.run.outcome import FitResult  # noqa: E402

__all__ = ["FitResult", "FunctionalModel", "Program", "Run", "TrainState", "build", "drive", "fit",
           "make_eval_step", "make_train_call", "make_train_step"]
__version__ = "0.1.0"
