"""Start a run from another run's weights (``preference.init_from``): a step-0 state, fresh optimizer.

The newest whole checkpoint of the other run (a trained run, or one ``functrain convert hf-to-functrain``
wrote) gives the params; the backend builds the rest of the state around them as for a converted model, so a
preference run's frozen reference is those weights too. Weights that do not fit the model are a one-line
CheckpointError naming the first mismatched parameter (LoRA adapters are added when missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flax.traverse_util import flatten_dict

from functrain.checkpoint import load_params_and_meta
from functrain.errors import CheckpointError
from functrain.models.lora import is_adapter


def initial_state_from(run_dir: Path, backend: Any) -> tuple[Any, dict[str, Any]]:
    """A step-0 state of the JAX ``backend`` whose weights are those of ``run_dir``'s newest checkpoint, and where
    they came from (``{"run": run_dir, "step": its step}``, for the start-up lines, the summary and the meta)."""
    params, meta = load_params_and_meta(run_dir)
    wanted = {
        path: tuple(leaf.shape)
        for path, leaf in flatten_dict(backend.abstract_state.params).items()
        if not is_adapter(path)
    }
    given = {path: tuple(leaf.shape) for path, leaf in flatten_dict(params).items() if not is_adapter(path)}
    for path in sorted(set(wanted) | set(given)):
        if wanted.get(path) != given.get(path):
            raise CheckpointError(
                f"the weights of {run_dir} (step {meta.get('step')}) do not fit this model: "
                f"{'/'.join(path)} is {given.get(path)} there and {wanted.get(path)} here; use "
                f"the same model section as that run"
            )
    return backend.state_from_items({"params": params, "state": None}), {"run": str(run_dir), "step": meta.get("step")}
