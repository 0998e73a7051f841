"""The report behind ``functrain inspect RUN_DIR [--step N] [--digest]``.

One table row per checkpoint (step, time, size, whole/damaged, best, epoch, samples consumed,
metrics), an optional SHA-256 of the parameters, and the last lines of metrics.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from functrain.errors import CheckpointError

if TYPE_CHECKING:
    from functrain.checkpoint.listing import CheckpointInfo

_TAIL_LINES = 5


def _metrics_text(metrics: Mapping[str, Any], prefix: str = "") -> str:
    parts = []
    for name, value in metrics.items():
        if name == "weight":  # the denominator of the means, not a metric
            continue
        if isinstance(value, Mapping):
            parts.append(_metrics_text(value, f"{prefix}{name}/"))
        elif isinstance(value, float):
            parts.append(f"{prefix}{name}={value:.4g}")
        else:
            parts.append(f"{prefix}{name}={value}")
    return " ".join(p for p in parts if p)


def _row(info: CheckpointInfo) -> str:
    from functrain.parallel.sharding import human_bytes

    when = (
        datetime.datetime.fromtimestamp(info.time, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        if info.time
        else "-"
    )
    meta = info.meta or {}
    status = "whole" if info.whole else ("interrupted" if (info.problem or "").startswith("uncommitted") else "damaged")
    row = (
        f"{info.step:<8} {when:<19}  {human_bytes(info.size):>10}  {status:<11} {'best' if info.is_best else '':<4} "
        f"{meta.get('epoch', '-')!s:>5} {meta.get('samples_consumed', '-')!s:>9}  {_metrics_text(info.metrics)}"
    )
    return row.rstrip() + (f"  [{info.problem}]" if info.problem else "")


def _tail(path: Path, count: int) -> list[str]:
    """The last ``count`` lines of a possibly large text file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(f.tell() - 256 * 1024, 0))
        lines = f.read().decode(errors="replace").splitlines()
    return lines[-count:]


def inspect_report(
    run_dir: str | os.PathLike, step: int | None = None, digest: bool = False, verify: bool = False
) -> str:
    """A human-readable report of a run's checkpoints; ``digest`` adds the params SHA-256.

    Without ``verify`` each step's items, commit markers, metadata and array metadata are checked (cheap at
    any size); with it every array is read and its files' checksums verified, which also finds truncated,
    zeroed or otherwise changed array files.

    ``step`` limits the table to that step and picks it for the digest (default: newest whole).
    Raises ``CheckpointError`` if ``run_dir`` holds no checkpoints, or ``step`` is not there / damaged.
    """
    # Imported here, not with the module: the CLI's parser imports every command's module, and these bring JAX (a
    # second of every command's start, the `--processes` launcher's among them).
    from functrain.checkpoint import layout
    from functrain.checkpoint.digest import params_digest
    from functrain.checkpoint.listing import list_checkpoints, load_params

    ckpt_dir, _ = layout.locate(run_dir)
    infos = list_checkpoints(ckpt_dir, verify=verify)
    if step is not None:
        infos = [i for i in infos if i.step == step]
        if not infos:
            raise CheckpointError(
                f"no checkpoint for step {step} in {ckpt_dir}; run `functrain inspect {run_dir}` to see the steps there"
            )
    whole = [i for i in infos if i.whole]
    checked = (
        "every array read and its checksums verified"
        if verify
        else "metadata checked; --verify reads every array and verifies its checksums"
    )
    lines = [
        (f"checkpoints: {ckpt_dir} ({len(whole)} whole, {len(infos) - len(whole)} damaged or interrupted; {checked})"),
        (f"{'step':<8} {'time (UTC)':<19}  {'size':>10}  {'status':<11} {'':<4} {'epoch':>5} {'samples':>9}  metrics"),
    ]
    lines += [_row(info) for info in infos]
    newest_meta = whole[-1].meta if whole and whole[-1].meta else {}
    if newest_meta.get("layout"):  # mesh, shardings of the largest params, state bytes per device
        lines.append(f"layout when step {whole[-1].step} was saved ({newest_meta.get('processes', 1)} process(es)):")
        lines += [f"  {line}" for line in str(newest_meta["layout"]).splitlines()]
    if digest:
        if not whole:
            raise CheckpointError(
                f"no whole checkpoint{'' if step is None else f' at step {step}'} in {ckpt_dir} "
                f"to digest; see the table above for what is damaged"
            )
        chosen = whole[-1].step
        lines.append(f"sha256 step {chosen}: {params_digest(load_params(ckpt_dir, step=chosen))}")
    metrics_file = ckpt_dir.parent / "metrics.jsonl"
    if metrics_file.is_file():
        lines.append(f"last lines of {metrics_file.name}:")
        lines += [f"  {line}" for line in _tail(metrics_file, _TAIL_LINES)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ the verb

HELP = "checkpoints, validity, metrics of a run directory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--step", type=int, default=None)
    parser.add_argument("--digest", action="store_true", help="print the SHA-256 of the parameters")
    parser.add_argument("--verify", action="store_true", help="read every array to find damaged checkpoints")
    parser.add_argument(
        "--goodput", action="store_true", help="productive step time and what was lost, from events.jsonl"
    )


def run(args: argparse.Namespace) -> int:
    if args.goodput:
        from functrain.report.goodput import goodput_report

        if not Path(args.run_dir).is_dir():
            raise CheckpointError(f"{args.run_dir} is not a directory; give the run directory of a run")
        print(goodput_report(args.run_dir))
        return 0
    print(inspect_report(args.run_dir, step=args.step, digest=args.digest, verify=args.verify))
    return 0
