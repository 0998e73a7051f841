"""torch_bridge: functrain's loop, data order and checkpoints for PyTorch models.

The step is pure (:func:`make_train_step`): detached parameter views in, new tensors out, with the JAX
step's micro-batching, clipping, non-finite policy and optax optimizer arithmetic. ``backend: torch`` in a
run config makes the loop use :mod:`torch_bridge.backend`, which trains the config's model or any
``nn.Module`` passed to ``fit(config, model=..., loss_fn=...)`` (:mod:`torch_bridge.user_model`). HF-style
checkpoint conversion lives in :mod:`torch_bridge.hf` and is imported only when asked for.
"""

from functrain.errors import TORCH_INSTALL

try:
    import torch  # noqa: F401  (fail here, with the fix, rather than deep inside a submodule)
except ImportError as error:  # pragma: no cover - exercised only where torch is absent
    raise ImportError(f"torch_bridge needs PyTorch ({error}); {TORCH_INSTALL}") from error

from torch_bridge.optim import Optimizer, adamw, from_settings, lion, make_optimizer, make_schedule, sgd
from torch_bridge.step import TorchState, make_eval_step, make_train_step, step_generator

__all__ = [
    "Optimizer",
    "TorchState",
    "adamw",
    "from_settings",
    "lion",
    "make_eval_step",
    "make_optimizer",
    "make_schedule",
    "make_train_step",
    "sgd",
    "step_generator",
]
