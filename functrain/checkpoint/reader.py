"""Read committed checkpoints back: meta, shape checks, arrays onto the current mesh, fallback.

Everything here only reads. A step that cannot be read (truncated or missing files, a missing item or
commit marker, unreadable meta, data files that differ from their checksums, an adapters-only LoRA step
whose base step is damaged or was replaced) is *damaged*:
``restore_newest`` tries the previous step, once per step, so it never loops, and logs one warning per
damaged step naming the step used instead (none when every step is damaged: the error says it all).
A step that reads fine but does not fit the model (shapes, paths) or was written by a newer format is
*incompatible*: that is a ``CheckpointError`` at once, never a fallback.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.checkpoint import checksum, compat, layout
from functrain.checkpoint.meta import LORA_BASE_FINGERPRINT, LORA_BASE_STEP, check_format_version, saved_items
from functrain.errors import CheckpointError
from functrain.models.stacking import relayout_layers, relayout_like
from functrain.parallel.distributed import every_process

log = logging.getLogger("functrain.checkpoint")

#: ``targets`` maps an item name ("params", "state") to an abstract tree, or to ``None`` for
#: "whatever was saved, as numpy arrays". Leaves that are ``jax.ShapeDtypeStruct`` with a sharding
#: restore as ``jax.Array`` on that sharding (any mesh); other leaves restore as ``np.ndarray``.
Targets = Mapping[str, Any]

_COMMIT_MARKER = "commit_success.txt"  # Orbax writes one per step and per item before the commit rename


class DamagedCheckpoint(Exception):
    """A committed step that cannot be read back; ``reason`` says what broke."""

    def __init__(self, step_path: Path, reason: str):
        super().__init__(f"{step_path}: {reason}")
        self.step_path = step_path
        self.reason = reason


def short_reason(error: BaseException) -> str:
    """One short line describing ``error``."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= 160 else text[:157] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def read_meta(step_path: Path) -> dict:
    """The JSON meta item of one step; ``DamagedCheckpoint`` if missing or unreadable."""
    handler = ocp.JsonCheckpointHandler()
    try:
        meta = handler.restore(step_path / layout.META, args=ocp.args.JsonRestore())
    except Exception as error:  # any read / decode failure means the step is not usable
        raise DamagedCheckpoint(step_path, f"unreadable meta ({short_reason(error)})") from error
    finally:
        handler.close()
    if not isinstance(meta, dict):
        raise DamagedCheckpoint(step_path, "meta is not a JSON object")
    return meta


def saved_tree_metadata(step_path: Path, item: str) -> Any:
    """Orbax's metadata tree (shapes, dtypes, saved shardings) of one item; ``DamagedCheckpoint`` if unreadable."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        return handler.metadata(step_path / item).tree
    except Exception as error:
        raise DamagedCheckpoint(step_path, f"unreadable {item} metadata ({short_reason(error)})") from error
    finally:
        handler.close()


def _numpy_target(metadata_tree: Any) -> Any:
    """An abstract target that restores the saved tree as numpy arrays on this host."""
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), metadata_tree)


def _restore_item(step_path: Path, item: str, target: Any) -> Any:
    handler = ocp.PyTreeCheckpointHandler()
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        return handler.restore(step_path / item, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args))
    except Exception as error:
        raise DamagedCheckpoint(step_path, f"unreadable {item} ({short_reason(error)})") from error
    finally:
        handler.close()


def _placed(tree: Any, target: Any) -> Any:
    """Numpy ``tree`` as ``target`` restores: each leaf on its target's sharding (any mesh, any number of
    processes), in its target's dtype; leaves of targets without a sharding stay numpy."""

    def place(array: Any, want: Any) -> Any:
        array = np.asarray(array, dtype=want.dtype)
        sharding = getattr(want, "sharding", None)
        if sharding is None:
            return array
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    return jax.tree.map(place, tree, target)


def check_whole(step_path: Path, meta: dict) -> None:
    """Raise ``DamagedCheckpoint`` unless every item the step was saved with is there and committed.

    A step missing its state, its params or a commit marker would otherwise restore as a fresh start or
    read half-written files (a converted model legitimately has params only: its meta says so). An
    adapters-only LoRA step also needs its base step (``_check_base_step``).
    """
    if not (step_path / _COMMIT_MARKER).is_file():
        raise DamagedCheckpoint(step_path, f"no commit marker ({_COMMIT_MARKER})")
    for item in saved_items(meta):
        if not (step_path / item).is_dir():
            raise DamagedCheckpoint(step_path, f"no {item} item")
        if not (step_path / item / _COMMIT_MARKER).is_file():
            raise DamagedCheckpoint(step_path, f"no commit marker in {item}/")
    if LORA_BASE_STEP in meta:
        _check_base_step(step_path, meta)


def _check_base_step(step_path: Path, meta: dict) -> None:
    """Raise ``DamagedCheckpoint`` unless the LoRA base step an adapters-only step names is there, as it was
    when the step was saved (same fingerprint)."""
    base_step = int(meta[LORA_BASE_STEP])
    if base_fingerprint(step_path.parent / str(base_step)) != meta.get(LORA_BASE_FINGERPRINT):
        raise DamagedCheckpoint(
            step_path, f"its LoRA base step {base_step} (the frozen base weights) is missing or was written again since"
        )


def verify_checksums(step_path: Path, meta: dict, items: Iterable[str]) -> None:
    """Raise ``DamagedCheckpoint`` if the data files of ``items`` differ from the checksums recorded at save.

    Steps saved before checksums were recorded pass unchecked. In a multi-process restore each process
    hashes a share of the files; the caller agrees on the outcome.
    """
    recorded = meta.get("checksums")
    if not isinstance(recorded, dict):
        return
    for item in items:
        problem = checksum.verify(step_path / item, recorded, jax.process_index(), jax.process_count())
        if problem:
            raise DamagedCheckpoint(step_path, problem)


def check_compatible(step_path: Path, meta: dict, targets: Targets) -> dict[str, Any]:
    """Compare saved shapes/dtypes/paths with ``targets``; return the metadata tree of each item to read.

    The step must be whole (``check_whole``); items in ``targets`` it was not saved with are skipped (a
    converted HF model has no optimizer state: it starts fresh). Raises ``CheckpointError`` listing every
    mismatched path with both shapes; reads no arrays.
    """
    check_whole(step_path, meta)
    trees, problems = {}, []
    for item, target in targets.items():
        if item not in saved_items(meta):
            continue
        trees[item] = saved_tree_metadata(step_path, item)
        if target is not None:
            expected = compat.flat_shapes(target)
            saved = compat.in_layout_of(compat.flat_shapes(trees[item]), expected)
            problems += compat.mismatches(item, saved, expected)
    if problems:
        raise CheckpointError(
            f"checkpoint {step_path} does not fit this model ({len(problems)} differences): "
            f"{compat.summarize(problems)}; use the model config it was trained with, or a new run.dir"
        )
    return trees


def base_fingerprint(step_path: Path) -> str | None:
    """What identifies a committed step holding LoRA base weights: a SHA-256 of its number, its save time and
    the xxh3 checksums of its params files; ``None`` when the step is not there or its meta is unreadable.

    Cheap (no array is read) yet it changes whenever the base step is written again, so an adapters-only step
    never restores onto a base it was not trained on.
    """
    try:
        meta = read_meta(step_path)
    except DamagedCheckpoint:
        return None
    digest = hashlib.sha256(f"{step_path.name}\0{meta.get('time')}".encode())
    for record in sorted((step_path / layout.PARAMS).glob("checksums.process_*.json")):
        digest.update(record.read_bytes())
    return digest.hexdigest()


def _with_base_params(step_path: Path, meta: dict, adapters: Any) -> Any:
    """The full params of an adapters-only LoRA step: its base step's params with its adapters added, in the
    adapters' layer layout (a base step saved with the layers scanned or not: ``model.scan_layers`` changed).

    A base step that is damaged makes this step damaged (restores fall back); ``check_whole`` has checked that
    it is the one recorded.
    """
    base_step = int(meta[LORA_BASE_STEP])
    base_path = step_path.parent / str(base_step)
    try:
        base_items, _ = restore_step(base_path, {layout.PARAMS: None})
    except DamagedCheckpoint as damaged:
        raise DamagedCheckpoint(step_path, f"its LoRA base step {base_step} is damaged ({damaged.reason})") from damaged
    params = dict(flatten_dict(base_items[layout.PARAMS]))
    params.update(flatten_dict(adapters))
    return relayout_layers(unflatten_dict(params), adapters)


def restore_step(step_path: Path, targets: Targets) -> tuple[dict, dict]:
    """Read one committed step onto ``targets``: ``(items, meta)``.

    An adapters-only LoRA step comes back with full params, its base step's weights added; its params
    target must then be ``None`` (as saved), which is what a LoRA run restores with.
    Raises ``DamagedCheckpoint`` if it (or its base step) cannot be read or its checksums do not match,
    ``CheckpointError`` if it does not fit.
    """
    meta = read_meta(step_path)
    check_format_version(meta, str(step_path))
    trees = check_compatible(step_path, meta, targets)
    # Checksums are checked while Orbax reads the arrays: both read the same files, the second mostly from
    # the page cache, so on a host with a spare core the check costs next to nothing.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="functrain-verify") as pool:
        verified = pool.submit(verify_checksums, step_path, meta, list(trees))
        items = {}
        for item, saved_tree in trees.items():
            target = targets[item]
            if target is None:
                items[item] = _restore_item(step_path, item, _numpy_target(saved_tree))
            elif compat.flat_shapes(saved_tree).keys() != compat.flat_shapes(target).keys():
                # Another layer layout (model.scan_layers changed): read as saved, convert, then place.
                saved = _restore_item(step_path, item, _numpy_target(saved_tree))
                items[item] = _placed(relayout_like(saved, target), target)
            else:
                items[item] = _restore_item(step_path, item, target)
        verified.result()
    if layout.PARAMS in items and LORA_BASE_STEP in meta:
        items[layout.PARAMS] = _with_base_params(step_path, meta, items[layout.PARAMS])
    return items, meta


def _restore_everywhere(ckpt_dir: Path, step: int, targets: Targets) -> tuple[tuple[dict, dict, int] | None, str]:
    """``((items, meta, step), "")`` when every process read ``step``, else ``(None, why not)``.

    Every process must resume from the same step: one that fails anywhere counts as damaged everywhere.
    """
    try:
        restored, reason = (*restore_step(layout.step_dir(ckpt_dir, step), targets), step), ""
    except DamagedCheckpoint as damaged:
        restored, reason = None, damaged.reason
    if every_process(restored is not None):
        return restored, ""
    return None, reason or "another process could not read it"


def restore_newest(
    ckpt_dir: Path, targets: Targets, step: str | int = "auto", step_key: str = "checkpoint.resume"
) -> tuple[dict, dict, int] | None:
    """Restore ``step`` ("auto": the newest step that reads cleanly; an int: exactly that step). ``step_key``:
    the setting that named the step, in errors (``--step`` where a run is read rather than resumed).

    Returns ``(items, meta, step)``, or ``None`` for "never" or when no step was ever committed.
    """
    other = (
        "use checkpoint.resume=auto"
        if step_key == "checkpoint.resume"
        else f"leave {step_key} out for the newest whole checkpoint"
    )
    if step == "never":
        return None
    steps = layout.committed_steps(ckpt_dir)
    if isinstance(step, bool) or not (step == "auto" or isinstance(step, int)):
        raise CheckpointError(f"checkpoint.resume must be 'auto', 'never' or a step number, got {step!r}")
    if isinstance(step, int):
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint for step {step} in {ckpt_dir} (steps there: "
                f"{_steps_text(steps)}); pick one of them or {other}"
            )
        restored, reason = _restore_everywhere(ckpt_dir, step, targets)
        if restored is None:
            raise CheckpointError(
                f"checkpoint step {step} in {ckpt_dir} is damaged ({reason}); pick another step or {other}"
            )
        return restored
    damaged: list[tuple[int, str]] = []  # newest first
    for candidate in reversed(steps):
        restored, reason = _restore_everywhere(ckpt_dir, candidate, targets)
        if restored is None:
            damaged.append((candidate, reason))
            continue
        if jax.process_index() == 0:  # said only now, when it is known what replaces them
            for bad_step, bad_reason in damaged:
                log.warning(
                    "checkpoint step %d in %s is damaged (%s); using step %d, the newest whole one",
                    bad_step,
                    ckpt_dir,
                    bad_reason,
                    candidate,
                )
        return restored
    if damaged:
        raise CheckpointError(
            f"all {len(steps)} checkpoints in {ckpt_dir} are damaged (newest step {damaged[0][0]}: "
            f"{damaged[0][1]}); move them away, or start over with a new run.dir"
        )
    return None


def _steps_text(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"
