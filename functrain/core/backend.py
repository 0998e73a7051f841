"""The Backend protocol: everything the loop asks of the framework that computes the steps.

The loop (:mod:`functrain.run.loop`) drives a built run through these methods and attributes alone; it
imports no framework and probes nothing. :class:`functrain.run.jax_backend.JaxBackend` and
``torch_bridge.backend.TorchBackend`` implement it, each from pieces the builder resolved (never from the
config); ``tests/core/test_backend_protocol.py`` checks both against it.

A *state* is the backend's own (a TrainState pytree, a TorchState); the loop only passes it back. Checkpoint
*items* are nested dicts of arrays, the same layout for both: ``{"params": ..., "state": {"step", "opt_state",
"rng", "model_state", ...}}``. Host batches are numpy arrays ``[K, B_local, ...]`` for a call of ``K`` steps.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    """What the loop needs from a framework (see the module docstring)."""

    name: str  # "jax" / "torch": recorded in checkpoints, which do not cross backends
    process_index: int  # this process among those of the job (jax.distributed or torch.distributed)
    process_count: int
    synchronous: bool  # a call has finished when train_call returns (the CPU torch step)
    writes_checkpoints: bool  # this process takes part in writing checkpoints
    devices: list[Any]  # the accelerators a step runs on, for MFU (empty: not reported)

    def init_state(self) -> Any:
        """A fresh step-0 state."""

    def restore_targets(self) -> dict[str, Any]:
        """Abstract checkpoint items (shapes, dtypes, placements) a restore fills in."""

    def state_to_items(self, state: Any) -> dict[str, Any]:
        """The checkpoint items of ``state``."""

    def state_from_items(self, items: dict[str, Any]) -> Any:
        """A state from restored items (without a ``state`` item: the optimizer starts fresh)."""

    def place(self, host_batches: dict[str, Any]) -> Any:
        """Host batches ``[K, B_local, ...]`` -> what ``train_call`` takes (called on the prefetch thread)."""

    def train_call(self, state: Any, batches: Any) -> tuple[Any, dict[str, Any]]:
        """Run ``K`` steps; metrics ``{name: [K]}`` stay on the device until ``to_host``."""

    def hot_path(self) -> contextlib.AbstractContextManager:
        """The context the steps are dispatched in: it forbids implicit device-to-host copies where the
        framework can (a stray ``float(loss)`` would make the host wait for every step)."""

    def eval_batch(self, state: Any, host_batch: dict[str, Any]) -> dict[str, Any]:
        """Metric sums of one evaluation batch ``[B_local, ...]``, summed over processes."""

    def add(self, totals: dict[str, Any], sums: dict[str, Any]) -> dict[str, Any]:
        """``totals + sums`` leaf by leaf, on the device."""

    def to_host(self, tree: Any) -> Any:
        """Device values as numpy (blocks until they are computed)."""

    def wait(self, tree: Any) -> None:
        """Block until what produced ``tree`` is done, copying nothing to the host."""

    def any_process(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over all processes, so every process takes the same (collective) path."""

    def step_of(self, state: Any) -> int:
        """The state's step (blocks)."""

    def nonfinite_steps_of(self, state: Any) -> int:
        """How many steps of the state's history were non-finite (blocks)."""

    def describe(self) -> str:
        """A startup report: devices, layout, sizes."""
