"""Checkpoints of a LoRA run: the frozen base weights once, then the adapters only.

The base weights never change during a LoRA run, so storing them in every step would only cost disk and save
time. The first step of a line of history holding full params is its *base step*: the converted step 0, the
step a run resumed from when it held full params, or a fresh run's first save. Every later save holds the
adapter leaves only and names its base step (``meta["lora_base_step"]`` and the base's fingerprint); reading
it back adds the base weights (``checkpoint.reader``), so every step still restores on its own. The base step
is protected from rotation for the whole run.

A QLoRA run (``model.lora.base_dtype``) saves its base quantized, once, in the same way. One that starts from a base
saved in another form (a float converted model, quantized as it is restored) saves its first step whole: that step,
holding the quantized base it trains on, becomes the base step of the later ones.
"""

from __future__ import annotations

from typing import Any, Mapping

from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.checkpoint import Checkpointer, layout
from functrain.checkpoint.meta import LORA_BASE_FINGERPRINT, LORA_BASE_STEP
from functrain.checkpoint.reader import base_fingerprint
from functrain.models.lora import is_adapter

# The model.lora keys that fix the form a base is saved in.
_BASE_FORM = ("base_dtype", "block_size", "double_quant")


def base_form(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """How the run that saved ``meta`` stores its frozen base: its quantization (``model.lora`` keys), or None for
    the params' own float dtype."""
    lora = (meta.get("model") or {}).get("lora") or {}
    if lora.get("base_dtype") is None:
        return None
    return {key: lora.get(key) for key in _BASE_FORM}


def adapters_only(params: Any) -> Any:
    """The adapter leaves of ``params`` (same nesting, base weights left out)."""
    return unflatten_dict({path: leaf for path, leaf in flatten_dict(params).items() if is_adapter(path)})


class AdapterSaves:
    """Saves a LoRA run's checkpoints through ``checkpointer``, the base weights in its base step only."""

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer
        self.base_step: int | None = None
        self._base_form: dict[str, Any] | None = None
        self._fingerprint: str | None = None

    def restored(self, meta: Mapping[str, Any], step: int) -> None:
        """The run resumed from ``step``: its base step is the one it names, or itself when it holds full params."""
        self.base_step = int(meta.get(LORA_BASE_STEP, step))
        self._base_form = base_form(meta)
        self._fingerprint = None
        self._checkpointer.protect(self.base_step)

    def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
        """Save ``items`` as ``step``: adapters only when the base step is on disk in the form this run keeps its
        base in, else full params (the step then becomes the base)."""
        fingerprint = self._base_fingerprint() if base_form(meta) == self._base_form else None
        if fingerprint is None:
            if self._checkpointer.save(step, items, meta):
                self.base_step, self._base_form, self._fingerprint = step, base_form(meta), None
                self._checkpointer.protect(step)
            return
        meta = {**meta, LORA_BASE_STEP: self.base_step, LORA_BASE_FINGERPRINT: fingerprint}
        self._checkpointer.save(step, {**items, layout.PARAMS: adapters_only(items[layout.PARAMS])}, meta)

    def _base_fingerprint(self) -> str | None:
        """The base step's fingerprint, read once it has committed; ``None`` when there is no base on disk
        (none saved yet, or its save failed under ``checkpoint.on_error=warn``)."""
        if self.base_step is None:
            return None
        if self._fingerprint is None:
            self._checkpointer.wait()  # a base step saved in the background must have committed
            path = layout.step_dir(self._checkpointer.directory, self.base_step)
            self._fingerprint = base_fingerprint(path) if self.base_step in self._checkpointer.steps() else None
        return self._fingerprint
