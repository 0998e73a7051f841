"""Checkpoints: atomic, async, rotating, keep-best, restore onto any mesh, fall back past damage.

Layout (Orbax ``CheckpointManager``)::

    RUN_DIR/checkpoints/<step>/params   the params pytree                 (always)
                              /state    the rest of the TrainState        (absent for a converted model)
                              /meta     JSON: format_version, step, time, items, checksums {algorithm,
                                        processes}, epoch, samples_consumed, metrics, best_metric {name,
                                        mode, keep_best, value}, versions, ...
                              /<item>/checksums.process_<i>.json   xxh3 of each file process i wrote

A LoRA step after its run's base step holds the adapters only in ``params`` and names the base step in its
meta (``lora_base_step``, ``lora_base_fingerprint``); reading it adds the base step's params, and a base
step that is damaged or was written again makes it damaged (``functrain.checkpoint.lora_saves``).

A step is whole when every item its meta lists is there with its commit marker and, when read, its files
match their checksums; anything else is damaged and restores fall back past it.

A save is written into ``<step>.orbax-checkpoint-tmp*`` and renamed on commit, so a step that is
listed was committed; an interrupted save is never listed (and is cleaned up by the next writer).

Writing, from the training loop::

    ckpt = Checkpointer(run_dir, keep=3, keep_best=1, best_metric="eval/loss", best_mode="min",
                        async_save=True, on_error="stop")
    restored = ckpt.restore(targets, step="auto")     # -> (items, meta, step) | None
    ...
    ckpt.save(step, {"params": params, "state": rest_of_state}, meta)   # returns after device->host copy
    ...
    ckpt.close()                                         # waits for the last save; surfaces its failure

``targets`` maps "params" / "state" to abstract trees: ``jax.ShapeDtypeStruct(shape, dtype,
sharding=NamedSharding(current_mesh, spec))`` leaves restore as ``jax.Array`` on the current mesh
(whatever mesh saved them); numpy arrays or struct leaves without a sharding restore as numpy.

Reading, from research code or the CLI::

    params = load_params(run_dir, step=None)     # nested dict of numpy arrays
    params, meta = load_params_and_meta(run_dir)  # the same, with the checkpoint's meta
    params_digest(params)                        # sha256 hex, identical across meshes and processes
    list_checkpoints(run_dir)                    # [CheckpointInfo(step, time, size, whole, problem, ...)]

Errors: a path that holds no checkpoint, a checkpoint that does not fit the model (every mismatched
path with both shapes), a meta from a newer format, or a failed save with ``on_error="stop"`` raise
``functrain.errors.CheckpointError`` with one line naming the problem and the fix. Nothing on disk
is deleted because of them.
"""

from functrain.checkpoint.digest import params_digest
from functrain.checkpoint.listing import CheckpointInfo, list_checkpoints, load_params, load_params_and_meta
from functrain.checkpoint.manager import Checkpointer
from functrain.checkpoint.meta import FORMAT_VERSION, metric_value, package_versions

__all__ = [
    "FORMAT_VERSION",
    "CheckpointInfo",
    "Checkpointer",
    "list_checkpoints",
    "load_params",
    "load_params_and_meta",
    "metric_value",
    "package_versions",
    "params_digest",
]
