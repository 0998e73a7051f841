"""``Checkpointer``: async, atomic, rotating checkpoints of one run at RUN_DIR/checkpoints.

A thin layer over ``orbax.checkpoint.CheckpointManager`` that adds what a training loop needs:

* retention by our own rule (latest ``keep`` + best ``keep_best``; never the newest, a best or the
  resumed-from step), applied only once the new step has committed;
* failures of a background save surfaced on the next ``save`` / ``wait`` / ``close``, turned into a
  warning or a ``CheckpointError`` per ``on_error``, with earlier checkpoints left intact;
* resume with fallback past damaged steps (see ``reader``).

Every process calls every method (Orbax synchronises them); only the primary process touches the
directory outside Orbax (renaming a stale step aside, removing a failed save's temporary dir).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from functrain.checkpoint import checksum, layout, reader, retention
from functrain.checkpoint.meta import complete_meta, metric_value
from functrain.errors import CheckpointError, ConfigError
from functrain.parallel.distributed import primary_view

log = logging.getLogger("functrain.checkpoint")

_DISK_PROBLEMS = (
    "No space left on device",
    "Disk quota exceeded",
    "Permission denied",
    "Read-only file system",
    "File too large",
)


def _save_failure_reason(error: BaseException) -> str:
    """The most useful one-line reason for a failed save: the OS error if there is one in the chain."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            where = f" ({seen.filename})" if seen.filename else ""
            return f"{os.strerror(seen.errno)}{where}"
        seen = seen.__cause__ or seen.__context__
    text = str(error)
    for problem in _DISK_PROBLEMS:
        if problem in text:
            return problem
    return reader.short_reason(error)


# A replicated array whose share per replica is smaller than this is written whole by one replica. Orbax's
# replica-parallel save splits every replicated array over its replicas by slicing it on each device: a program
# compiled for each shape on each device, which costs far more than writing a norm's or a bias's kilobytes once (a
# data-parallel save of a small model over 8 CPU devices compiled 336 of them, a sixth of its process's CPU time).
# Large arrays are still written by all their replicas in parallel.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20


def _type_handlers(copy_host_arrays: bool) -> Any:
    """Orbax's type handlers, with replica-parallel saving for large arrays only (REPLICA_PARALLEL_MIN_BYTES) and,
    without ``copy_host_arrays``, numpy leaves written without being copied first.

    Orbax deep-copies host arrays when a save starts, in case the caller changes them during a background
    write; for a blocking save that copy only doubles peak memory (converting a 1.07 GB model peaked at
    2.57 GB instead of 1.57 GB).
    """
    handlers = ocp.type_handlers
    # Orbax's own handler, copied (its constructor takes no argument for the metadata store this one holds).
    arrays: Any = copy.copy(handlers.get_type_handler(jax.Array))
    arrays._min_slice_bytes_for_replica_parallel = REPLICA_PARALLEL_MIN_BYTES
    own = {jax.Array: arrays}
    if not copy_host_arrays:
        own[np.ndarray] = handlers.NumpyHandler(deepcopy_host_arrays=False)
    return handlers.create_type_handler_registry(
        *[(kind, own.get(kind) or handlers.get_type_handler(kind)) for kind in handlers.supported_types()]
    )


class _ChecksummedPyTreeHandler(ocp.PyTreeCheckpointHandler):
    """Orbax's pytree handler whose commit also records checksums of the files this process wrote."""

    async def async_save(self, directory: Any, *args: Any, **kwargs: Any) -> list[Any]:
        writes = await super().async_save(directory, *args, **kwargs) or []
        return [checksum.RecordAfterWrites(writes, Path(directory), ocp.multihost.process_index())]


class Checkpointer:
    """Saves and restores the checkpoints of one run (RUN_DIR/checkpoints/<step>/).

    Args:
      run_dir: the run directory; checkpoints go to ``run_dir/checkpoints``.
      keep: how many of the latest checkpoints to keep (``None``: keep all).
      keep_best: how many best checkpoints by ``best_metric`` to keep in addition.
      best_metric: "split/name" looked up in ``meta["metrics"]`` (e.g. "eval/loss").
      best_mode: "min" or "max".
      async_save: write in the background; ``save`` returns after the device->host copy.
      on_error: "stop" (raise ``CheckpointError``) or "warn" (log and keep training) when a save fails.
      is_primary: whether this process does the directory housekeeping (default: process 0).
      barrier_timeout_s: limit for Orbax's cross-process waits during a background save.
      checksums: record checksums of the written files (see ``checksum``), verified whenever the step is
        read; off only saves reading the files back once (worth it on slow remote storage).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        keep: int | None = 3,
        keep_best: int = 0,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        on_error: str = "stop",
        is_primary: bool | None = None,
        barrier_timeout_s: int = 1200,
        checksums: bool = True,
    ):
        if keep is not None and keep < 1:
            raise ConfigError(f"checkpoint.keep must be at least 1 (the newest is always kept), got {keep}")
        if keep_best < 0 or (keep_best and not best_metric):
            raise ConfigError("checkpoint.keep_best > 0 needs checkpoint.best_metric, e.g. 'eval/loss'")
        if best_metric is not None and "/" not in best_metric:
            raise ConfigError(f"checkpoint.best_metric must be 'split/name' like 'eval/loss', got {best_metric!r}")
        if best_mode not in ("min", "max"):
            raise ConfigError(f"checkpoint.best_mode must be 'min' or 'max', got {best_mode!r}")
        if on_error not in ("stop", "warn"):
            raise ConfigError(f"checkpoint.on_error must be 'stop' or 'warn', got {on_error!r}")
        self.directory = layout.checkpoints_dir(run_dir)
        self._keep, self._keep_best, self._best_mode = keep, keep_best, best_mode
        self._best_metric, self._on_error, self._async = best_metric, on_error, async_save
        self._is_primary = jax.process_index() == 0 if is_primary is None else is_primary
        self._checksums = checksums
        self._manager = self._open_manager(barrier_timeout_s)
        self._protected: set[int] = set()
        self._pending: int | None = None  # step whose background save has not been checked yet
        self._threads_before_save: set[threading.Thread] = set()
        self._line_head: int | None = None  # newest committed step of this run's line of history
        self._resumed_from: int | None = None
        self._closed = False
        self._metrics = {step: self._read_metric(step, best_metric) for step in self.steps()} if best_metric else {}

    def _open_manager(self, barrier_timeout_s: int) -> ocp.CheckpointManager:
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"{self.directory} is a file, not a directory; move it away so checkpoints can be written there"
            )
        # A read-only run directory fails here, once, rather than in the middle of the run's first write.
        existing = next(path for path in (self.directory, *self.directory.parents) if path.exists())
        if not os.access(existing, os.W_OK):
            raise CheckpointError(
                f"cannot write checkpoints to {self.directory}: {existing} is read-only "
                f"(permissions or a read-only file system); fix that or choose another run.dir"
            )
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=self._async,
            create=True,
            cleanup_tmp_directories=True,
            save_root_metadata=False,
            enable_background_delete=True,  # rmtree off the training thread
            # Synchronous directory creation: a full disk or unwritable directory then fails inside
            # save() at once, instead of leaving background writers waiting for a signal until timeout.
            async_options=ocp.AsyncOptions(timeout_secs=barrier_timeout_s, create_directories_asynchronously=False),
        )
        # Weights barely compress (zstd gains ~10%) but compressing costs the CPU time a background save
        # should leave to training, so items are written uncompressed; readers handle either.
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        # A blocking save cannot race its caller, so it skips Orbax's defensive copy of numpy leaves.
        handler_options = {"type_handler_registry": _type_handlers(copy_host_arrays=self._async)}
        handler_cls = _ChecksummedPyTreeHandler if self._checksums else ocp.PyTreeCheckpointHandler
        for item in (layout.PARAMS, layout.STATE, layout.EXPERIENCE):
            registry.add(item, ocp.args.PyTreeSave, handler_cls(use_compression=False, **handler_options))
        registry.add(layout.META, ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        try:
            return ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)
        except OSError as error:
            raise CheckpointError(
                f"cannot use checkpoint directory {self.directory} "
                f"({_save_failure_reason(error)}); fix its permissions or choose another run.dir"
            ) from error

    # ----------------------------------------------------------------------------------- queries
    def steps(self) -> list[int]:
        """Committed steps on disk, oldest first."""
        return layout.committed_steps(self.directory)

    @property
    def resumed_from(self) -> int | None:
        """The step this run restored from, if any."""
        return self._resumed_from

    def protect(self, step: int) -> None:
        """Never delete ``step`` during this run (the resumed-from step is protected automatically)."""
        self._protected.add(int(step))

    # ----------------------------------------------------------------------------------- saving
    def save(self, step: int, items: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> bool:
        """Start saving ``items`` ("params", optional "state" and "experience": pytrees of arrays) and ``meta`` as
        ``step``.

        Returns after the device->host copy; the write and the atomic commit happen in the
        background. A failure of the previous background save is surfaced here first. Returns
        False when nothing was started: ``step`` is already on disk from this run, or the save
        failed and ``on_error`` is "warn".
        """
        self._check_open()
        step = int(step)
        unknown = set(items) - {layout.PARAMS, layout.STATE, layout.EXPERIENCE}
        if layout.PARAMS not in items or unknown:
            raise ValueError(
                f"checkpoint items must be 'params' and optionally 'state' and 'experience', got {sorted(items)}"
            )
        self._settle()
        if primary_view(step in self.steps()):
            if step in self._protected or step == self._line_head:
                return False  # this exact state is already committed (e.g. a final save right after resume)
            self._move_aside(step)
        best = None
        if self._best_metric:
            best = {"name": self._best_metric, "mode": self._best_mode, "keep_best": self._keep_best}
        args = {name: ocp.args.PyTreeSave(tree) for name, tree in items.items() if tree is not None}
        full_meta = complete_meta(
            meta,
            step,
            best,
            items=sorted(args),
            checksums=checksum.meta_record(jax.process_count()) if self._checksums else None,
        )
        self._threads_before_save = set(threading.enumerate())
        try:
            self._manager.save(step, args=ocp.args.Composite(**args, meta=ocp.args.JsonSave(full_meta)), force=True)
        except Exception as error:  # noqa: BLE001 -- the directory or disk refused the write
            self._failed(step, error)
            return False
        self._pending = step
        if self._best_metric:
            self._metrics[step] = metric_value(full_meta, self._best_metric)
        if not self._async:
            self._settle()
        return True

    def wait(self) -> None:
        """Block until the save in flight has committed; surface its failure; apply retention."""
        self._check_open()
        self._settle()

    def close(self) -> None:
        """``wait``, then release Orbax's threads. Safe to call twice."""
        if self._closed:
            return
        try:
            self._settle()
        finally:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("Checkpointer is closed")

    def _settle(self) -> None:
        """Finish the pending background save: surface its failure or, once committed, rotate."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001 -- the background write failed; the step never committed
            self._failed(step, error)
            return
        if step not in self.steps():
            self._failed(step, RuntimeError("the step directory is missing after commit"))
            return
        self._line_head = step
        self._apply_retention()

    def _apply_retention(self) -> None:
        # Steps newer than this run's head belong to an abandoned line of history (resume from an
        # older step): not ours to rotate; a save that reaches one of them moves it aside first.
        # Orbax's own list: a step whose deletion is still running in the background is already gone.
        head = self._line_head
        if head is None:  # nothing committed by this run yet
            return
        steps = [s for s in self._manager.all_steps() if s <= head]
        doomed = retention.steps_to_delete(
            steps,
            keep=self._keep,
            keep_best=self._keep_best,
            metrics=self._metrics,
            mode=self._best_mode,
            protected=self._protected | {head},
        )
        for step in doomed:
            try:
                self._manager.delete(step)
            except Exception as error:  # noqa: BLE001 -- a leftover old checkpoint is harmless; say so and go on
                log.warning(
                    "could not delete old checkpoint step %d in %s (%s)",
                    step,
                    self.directory,
                    _save_failure_reason(error),
                )
            self._metrics.pop(step, None)

    def _failed(self, step: int, error: BaseException) -> None:
        """A save did not commit: clean its temporary dir, then warn or raise per ``on_error``."""
        self._join_writers()
        if self._is_primary:
            for tmp in layout.uncommitted_dirs(self.directory):
                if ocp.path.step.step_from_checkpoint_name(tmp.name) == step:
                    shutil.rmtree(tmp, ignore_errors=True)
        self._manager.reload()
        steps = self.steps()
        newest = f"newest: step {steps[-1]}" if steps else "there are none yet"
        message = (
            f"could not save checkpoint step {step} in {self.directory} "
            f"({_save_failure_reason(error)}); earlier checkpoints are intact ({newest})"
        )
        if self._on_error == "warn":
            log.warning("%s; training continues (checkpoint.on_error=warn)", message)
            return
        raise CheckpointError(
            f"{message}; free disk space or fix the directory's permissions, "
            f"or set checkpoint.on_error=warn to keep training without it"
        ) from error

    def _join_writers(self, timeout_s: float = 60.0) -> None:
        """Wait for the writer threads the failed save started. Orbax raises the first item's failure while
        the other items' writers still run; one finishing after the cleanup would leave files behind."""
        deadline = time.monotonic() + timeout_s
        for thread in set(threading.enumerate()) - self._threads_before_save:
            # Orbax's own thread classes are one-shot (a writer, a finaliser); anything else may be long-lived.
            if thread is not threading.current_thread() and type(thread).__module__.startswith("orbax"):
                try:
                    thread.join(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - Orbax's threads re-raise on join the failure being handled here
                    pass

    def _move_aside(self, step: int) -> None:
        """Rename a committed step we are about to save again (damaged, or from an abandoned line)."""
        target = self.directory / f"{step}.replaced-{int(time.time())}"
        if self._is_primary:
            os.rename(layout.step_dir(self.directory, step), target)
            log.warning(
                "checkpoint step %d already exists in %s but is not this run's; moved it to %s",
                step,
                self.directory,
                target.name,
            )
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes("functrain_checkpoint_move_aside", timeout=300)
        self._manager.reload()
        self._metrics.pop(step, None)

    def _read_metric(self, step: int, name: str) -> float | None:
        try:
            return metric_value(reader.read_meta(layout.step_dir(self.directory, step)), name)
        except reader.DamagedCheckpoint:
            return None

    # ----------------------------------------------------------------------------------- restoring
    def restore(self, targets: reader.Targets, step: str | int = "auto") -> tuple[dict, dict, int] | None:
        """Restore ``(items, meta, step)`` onto ``targets`` (see ``reader.Targets``), or ``None``.

        ``step``: "auto" (newest step that reads cleanly, falling back past damaged ones with one
        warning each), an int (exactly that step), or "never". Items the checkpoint lacks (e.g.
        "state" of a converted model) are absent from ``items``. The restored step is protected
        from deletion for the rest of the run.
        """
        self._check_open()
        self._settle()
        result = reader.restore_newest(self.directory, targets, step)
        if result is not None:
            self._resumed_from = self._line_head = result[2]
            self.protect(result[2])
        return result
