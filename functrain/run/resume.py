"""Where a run starts and what its checkpoints say about it: the resume policy, apart from the loop.

A run starts from the newest whole checkpoint (``checkpoint.resume: auto``), a named step, or fresh
(``never``). A step request acts once: a rerun of the same command after a preemption continues from the
newest checkpoint that request started. ``data.ignore_skip`` / ``data.skip_samples`` move the data position
once, too: a checkpoint records them, so a restart after it continues from its own position. A checkpoint
written by the other backend or another optimizer is refused by name before a restore would fail on
mismatched structures. :meth:`ResumePolicy.meta` writes all of this into each checkpoint's meta.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from functrain.checkpoint import list_checkpoints
from functrain.checkpoint.local import LocalCheckpoints
from functrain.checkpoint.local_restore import restore_local
from functrain.core.backend import Backend
from functrain.data import check_resume, data_meta, resume_position
from functrain.data.kinds import Order
from functrain.errors import CheckpointError, ConfigError


@dataclass
class Start:
    """Where the run starts: its state, data position and the checkpoint it came from (if any)."""

    state: Any
    position: int
    meta: dict[str, Any] | None = None
    restored_step: int | None = None
    position_jump: dict[str, int] | None = None  # where skip_samples/ignore_skip moved the data
    # The run whose weights this one began with (train.init_from): {"run", "step"}, kept in every checkpoint's meta.
    started_from: dict[str, Any] | None = None
    source: str | None = None  # where the restored step came from: local, peer or persistent (None: fresh)


@dataclass(frozen=True)
class ResumePolicy:
    """The settings that decide where a run starts, and the facts its checkpoints record about it."""

    run_dir: Path
    request: str | int  # checkpoint.resume: "auto", "never" or a step
    ignore_skip: bool
    skip_samples: int | None
    data_seed: int
    backend: str
    optimizer: dict[str, Any]  # the optimizer section as recorded (its name must match on resume)
    record: dict[str, Any] = field(default_factory=dict)  # config digest, model section: written in every meta
    # The state of a run started from another run's weights (train.init_from) when it has no checkpoint, and
    # where they came from ({"run", "step"}).
    initial_state: Callable[[Backend], tuple[Any, dict[str, Any]]] | None = None

    def data_override(self) -> dict[str, Any]:
        """The one-time data position settings of this run, recorded in its checkpoints."""
        return {"ignore_skip": self.ignore_skip, "skip_samples": self.skip_samples}

    def effective_request(self) -> str | int:
        """``request``, except that a step request acts once: when a newer checkpoint was written by a run
        started from that request, resume ``auto``."""
        if isinstance(self.request, int):
            newest = [info for info in list_checkpoints(self.run_dir, verify=False) if info.whole]
            if (
                newest
                and newest[-1].step > self.request
                and (newest[-1].meta or {}).get("resume_request") == self.request
            ):
                return "auto"
        return self.request

    def check_saved_run_fits(self, request: str | int, meta: dict | None = None, step: int | None = None) -> None:
        """Name what changed when the checkpoint to resume from was written by another backend or optimizer.
        ``meta``/``step``: of the checkpoint restored; None: of the one the request points at."""
        if meta is None:
            if request == "never":
                return
            candidates = [
                info
                for info in list_checkpoints(self.run_dir, verify=False)
                if info.whole and info.meta and (request == "auto" or info.step == request)
            ]
            if not candidates:
                return
            meta, step = candidates[-1].meta or {}, candidates[-1].step  # meta: set, as filtered
        where = f"checkpoint {step} in {self.run_dir}"
        saved_backend = meta.get("backend", "jax")
        if saved_backend != self.backend:
            raise CheckpointError(
                f"{where} was written by backend {saved_backend}, this run uses backend "
                f"{self.backend} (their states differ); set backend={saved_backend} or "
                f"use a new run.dir"
            )
        saved_optimizer, name = (meta.get("optimizer") or {}).get("name"), self.optimizer.get("name")
        if saved_optimizer is not None and saved_optimizer != name:
            raise CheckpointError(
                f"{where} holds {saved_optimizer} optimizer state but this run sets "
                f"optimizer.name={name} (the optimizer state does not carry over); set "
                f"optimizer.name={saved_optimizer} or use a new run.dir"
            )

    def start(
        self,
        checkpointer: Any,
        backend: Backend,
        sampler: Order,
        adapter_saves: Any = None,
        local: LocalCheckpoints | None = None,
        resume_experience: Callable[[dict[str, Any]], None] | None = None,
    ) -> Start:
        """The starting state and data position: from the checkpoint the request names (with ``auto``, a step
        of the local checkpoints when one is at least as new as the newest persistent step), or fresh. A task's
        experience stage that keeps running totals continues them from the restored checkpoint's meta
        (``resume_experience``, its ``resume``)."""
        request = self.effective_request()
        self.check_saved_run_fits(request)
        restored: tuple[dict, dict, int] | None = None
        source = "persistent"
        if local is not None and request == "auto":
            whole = [info.step for info in list_checkpoints(self.run_dir, verify=False) if info.whole]
            from_local = restore_local(local, backend.restore_targets(), whole[-1] if whole else None)
            if from_local is not None:
                restored, source = from_local[:3], from_local[3]
        if restored is None:
            restored = checkpointer.restore(backend.restore_targets(), step=request)
        if restored is None:
            fresh = resume_position(None, self.ignore_skip, self.skip_samples)
            if self.initial_state is not None:
                state, weights_from = self.initial_state(backend)
                return Start(state, fresh, started_from=weights_from)
            return Start(backend.init_state(), fresh)
        items, meta, step = restored
        if adapter_saves is not None:
            adapter_saves.restored(meta, step)
        self.check_saved_run_fits(request, meta, step)
        ignore_skip, skip_samples = self.ignore_skip, self.skip_samples
        if meta.get("data_override") == self.data_override():  # already applied by the run that saved it
            ignore_skip, skip_samples = False, None
        check_resume(meta, sampler.num_records, self.data_seed, ignore_skip, skip_samples)
        state = backend.state_from_items(items)
        position = resume_position(meta, ignore_skip, skip_samples)
        # A mixture continues its data schedule, a stream its saved state (no-ops for plain data).
        sampler.restore(None if ignore_skip else meta, position)
        if resume_experience is not None:
            resume_experience(meta)
        saved_position = int(meta.get("samples_consumed", 0))
        jump = {"step": step, "from": saved_position, "to": position} if position != saved_position else None
        return Start(state, position, meta, step, jump, meta.get("started_from"), source)

    def meta(
        self,
        step: int,
        sampler: Order,
        position: int,
        previous: dict[str, Any] | None,
        position_jump: dict[str, int] | None,
        metrics: dict[str, Any],
        backend: Backend,
        started_from: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The JSON meta item of the checkpoint at ``step``: the data position and its history (continued from
        the ``previous`` meta), this run's record, the run whose weights it began with, and what wrote it."""
        return {
            "step": step,
            **data_meta(sampler, position, previous, position_jump),
            **self.record,
            "backend": self.backend,
            "optimizer": self.optimizer,
            "metrics": metrics,
            "time": time.time(),
            "layout": backend.describe(),
            "processes": backend.process_count,
            "data_override": self.data_override(),
            "resume_request": self.request if isinstance(self.request, int) else None,
            "started_from": started_from,
        }


def describe_source(started_from: dict[str, Any]) -> str:
    """``{"run": "runs/a", "step": 500}`` -> ``runs/a at step 500``."""
    return f"{started_from.get('run')} at step {started_from.get('step')}"


def write_run_config(run_dir: Path, config: dict[str, Any]) -> None:
    """Write the resolved config atomically; a different earlier config is kept beside it, never lost."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create run.dir {str(run_dir)!r} ({exc.strerror}); choose another run.dir") from None
    target = run_dir / "config.yaml"
    text = yaml.safe_dump(config, sort_keys=False)
    if target.exists() and target.read_text() != text:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(target.stat().st_mtime))
        target.replace(run_dir / f"config.{stamp}.yaml")
    tmp = run_dir / f".config.yaml.tmp-{os.getpid()}"
    tmp.write_text(text)
    tmp.replace(target)
