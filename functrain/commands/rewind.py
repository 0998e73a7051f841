"""``functrain rewind RUN_DIR --to STEP --skip-samples K``: go back past a loss spike and step over its data.

Training resumes from the checkpoint at ``STEP`` with the data position moved ``K`` samples further
(``checkpoint.resume=STEP``, ``data.skip_samples=<position at STEP> + K``: the loop's one-time position
override). Because a batch is a pure function of its position, the run then sees exactly the samples it
would have seen, minus those K. The move is recorded in every later checkpoint's meta
(``position_jumps``), so a plain resume continues the rewound history. Checkpoints after ``STEP`` belong to
the abandoned history: they move to ``RUN_DIR/checkpoints.abandoned/`` (nothing is deleted), and metric
lines after ``STEP`` move to ``metrics.abandoned.jsonl`` as on any resume.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from functrain.errors import CheckpointError, ConfigError
from functrain.guards.lock import RunLock

ABANDONED_CHECKPOINTS = "checkpoints.abandoned"


def plan_rewind(run_dir: Path, step: int, skip_samples: int) -> tuple[int, list[int]]:
    """``(position to resume at, later checkpoint steps to set aside)``; raises before anything changes."""
    from functrain.checkpoint import layout, list_checkpoints  # with JAX: not at the CLI's start (commands.inspect)

    if skip_samples < 0:
        raise ConfigError(f"--skip-samples {skip_samples} is negative; pass 0 or more samples to skip")
    ckpt_dir, _ = layout.locate(run_dir)
    infos = [info for info in list_checkpoints(ckpt_dir, verify=False) if info.whole]
    steps = [info.step for info in infos]
    if step not in steps:
        newest = f"the newest is {steps[-1]}" if steps else "there is none"
        beyond = (
            f"step {step} is after the newest checkpoint ({newest})"
            if not steps or step > steps[-1]
            else f"there is no whole checkpoint at step {step}"
        )
        raise CheckpointError(
            f"cannot rewind {run_dir}: {beyond}; pick one of the steps "
            f"{', '.join(map(str, steps)) or 'none'} (functrain inspect {run_dir})"
        )
    meta = next(info.meta for info in infos if info.step == step) or {}
    if meta.get("samples_consumed") is None:
        raise CheckpointError(
            f"checkpoint {step} in {run_dir} records no data position (a converted model?); "
            f"rewind needs a checkpoint written by functrain train"
        )
    return int(meta["samples_consumed"]) + skip_samples, [s for s in layout.committed_steps(ckpt_dir) if s > step]


def set_aside_checkpoints(run_dir: Path, steps: list[int]) -> None:
    """Move the checkpoints of ``steps`` to ``RUN_DIR/checkpoints.abandoned/`` (a name taken gets a suffix)."""
    from functrain.checkpoint import layout

    ckpt_dir, _ = layout.locate(run_dir)
    aside = run_dir / ABANDONED_CHECKPOINTS
    aside.mkdir(exist_ok=True)
    for step in steps:
        target, copy = aside / str(step), 1
        while target.exists():
            target, copy = aside / f"{step}.{copy}", copy + 1
        layout.step_dir(ckpt_dir, step).rename(target)


def rewind(run_dir: str | os.PathLike, step: int, skip_samples: int, overrides: list[str] | None = None) -> Any:
    """Resume ``run_dir`` from checkpoint ``step`` with the next ``skip_samples`` samples skipped; train on
    as ``RUN_DIR/config.yaml`` (plus dotted ``overrides``) says. Returns the :class:`FitResult`."""
    from functrain.config.load import load_config
    from functrain.report.events import append_event
    from functrain.run.fit import fit

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} has no config.yaml; pass the run.dir of a training run")
    position, later = plan_rewind(run_dir, step, skip_samples)
    config = load_config(
        run_dir / "config.yaml",
        [*(overrides or []), f"run.dir={run_dir}", f"checkpoint.resume={step}", f"data.skip_samples={position}"],
    )
    with RunLock(run_dir):  # not while another job trains in this directory
        set_aside_checkpoints(run_dir, later)
        append_event(run_dir, "rewind", step, skip_samples=skip_samples, position=position)
    return fit(config)


# ------------------------------------------------------------------------------------------ the verb

HELP = "resume from checkpoint STEP skipping the next K samples"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--to", type=int, required=True, metavar="STEP", help="checkpoint step to go back to")
    parser.add_argument("--skip-samples", type=int, required=True, metavar="K", help="samples to step over")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")


def run(args: argparse.Namespace) -> int:
    result = rewind(args.run_dir, args.to, args.skip_samples, args.overrides)
    print(
        f"functrain: rewound to step {args.to}, skipped {args.skip_samples} samples; {result.stop_reason} at "
        f"step {result.step}; run directory {result.run_dir}"
    )
    return result.exit_code
