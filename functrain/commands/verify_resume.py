"""``functrain verify-resume CONFIG [--steps N]``: prove that a run killed and resumed equals one that never was.

Trains ``N`` steps twice in temporary run directories, each in its own process: once uninterrupted, once
killed with SIGKILL at a random step after its first checkpoint (the process kills itself at that call
boundary, so the kill lands where asked however fast the steps are, possibly with a save in flight) and then
resumed by a fresh process.
Then it compares the final parameters (SHA-256 of the params) and every logged training metric step by step,
and prints PASS, or FAIL with the first step that differs. Both runs log every call and checkpoint a few
times; trackers, plots and samples are off. ``--import MODULE`` imports modules in the training processes
first (code that registers a model or a dataset).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from functrain.callbacks.base import Callback
from functrain.callbacks.view import RunView
from functrain.errors import EXIT_BAD_INPUT, FunctrainError

# Metrics that are functions of the computation; throughput and positions are left out.
COMPARED = (
    "loss",
    "grad_norm",
    "learning_rate",
    "accuracy",
    "nonfinite_steps",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
    "reward",
    "kl",
    "completions/mean_length",
    "num_tokens",
)


@dataclass
class Verdict:
    """The outcome: ``passed``, the kill and resume steps, and the first difference (None when equal)."""

    passed: bool
    steps: int
    killed_at: int
    resumed_from: int
    first_difference: str | None
    digests: tuple[str, str]

    def report(self) -> str:
        """One PASS/FAIL paragraph."""
        head = (
            f"{'PASS' if self.passed else 'FAIL'}: {self.steps} steps uninterrupted vs killed (SIGKILL) at "
            f"step {self.killed_at} and resumed from checkpoint {self.resumed_from}"
        )
        same = self.digests[0] == self.digests[1]
        lines = [head]
        if self.digests != ("-", "-"):
            lines.append(
                f"  params sha256 {'equal' if same else 'differ'}: {self.digests[0][:16]}"
                + ("" if same else f" vs {self.digests[1][:16]}")
            )
        lines.append(
            f"  first difference: {self.first_difference}"
            if self.first_difference
            else "  logged training metrics equal at every step"
        )
        return "\n".join(lines)


def _train_command(
    config: str, run_dir: Path, overrides: list[str], imports: list[str], kill_step: int | None = None
) -> list[str]:
    code = (
        "import importlib\n"
        f"for name in {imports!r}: importlib.import_module(name)\n"
        "from functrain.commands.verify_resume import train_worker\n"
        f"train_worker({config!r}, {[*overrides, f'run.dir={run_dir}']!r}, {kill_step!r})"
    )
    return [sys.executable, "-c", code]


class KillAt(Callback):
    """SIGKILLs its own process at the first call boundary at or after ``step`` once a checkpoint is
    committed (a save may still be in flight): the kill lands exactly where asked, however fast the steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, view: RunView) -> None:
        if view.step >= self.step and _committed(view.run_dir):
            os.kill(os.getpid(), signal.SIGKILL)


def train_worker(config: str, overrides: list[str], kill_step: int | None) -> None:
    """One training process of the check (``kill_step``: die there); bad input exits 2 with one line."""
    from functrain.config.load import load_config
    from functrain.run.fit import fit

    try:
        result = fit(load_config(config, overrides), callbacks=[KillAt(kill_step)] if kill_step is not None else [])
    except FunctrainError as exc:
        print(f"functrain: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    if result.exit_code:
        print(f"functrain: {result.stop_reason}", file=sys.stderr)
    sys.exit(result.exit_code)


def _environment() -> dict[str, str]:
    """This process's environment, with this functrain first on the path of the training processes."""
    package_root = str(Path(__file__).resolve().parents[1])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))


def logged_training(run_dir: Path) -> dict[int, dict]:
    """The training metrics ``run_dir``'s metrics file holds, by step (a step logged twice, before a kill and after
    the resume: its last line)."""
    path = run_dir / "metrics.jsonl"
    lines = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return {line["step"]: line for line in lines if line.get("split") == "train"}


def _run(command: list[str], what: str) -> None:
    proc = subprocess.run(command, capture_output=True, text=True, env=_environment())
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FunctrainError(f"the {what} training run failed (exit {proc.returncode}): {last}")


def _committed(run_dir: Path) -> list[int]:
    from functrain.checkpoint import layout

    return layout.committed_steps(layout.checkpoints_dir(run_dir))


def _kill_at(command: list[str], run_dir: Path) -> int:
    """Run training that kills itself (see :class:`KillAt`); the last step it logged."""
    proc = subprocess.run(command, capture_output=True, text=True, env=_environment())
    if proc.returncode != -signal.SIGKILL:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise FunctrainError(
            f"the interrupted training run ended with exit {proc.returncode} instead of being killed: {last}"
        )
    return max(logged_training(run_dir), default=0)


def first_difference(reference: dict[int, dict], resumed: dict[int, dict]) -> str | None:
    """The first step (and metric of :data:`COMPARED`) at which two runs' logged training differs; None if none."""
    for step in sorted(set(reference) | set(resumed)):
        if step not in reference or step not in resumed:
            return f"step {step} logged by only the {'uninterrupted' if step in reference else 'resumed'} run"
        for name in COMPARED:
            a, b = reference[step].get(name), resumed[step].get(name)
            if a != b:
                return f"step {step}: {name} {a!r} (uninterrupted) vs {b!r} (resumed)"
    return None


def save_interval(steps: int, per_call: int) -> int:
    """Steps between the checks' checkpoints: about four in ``steps``, each at a call boundary."""
    return per_call * max(1, steps // (4 * per_call))


def checked_settings(steps: int, per_call: int) -> list[str]:
    """The overrides both runs of the check train under: ``steps`` steps, every call logged, a few checkpoints,
    resume from the newest; no progress, plots, trackers or samples beside the metrics file."""
    return [
        f"train.max_steps={steps}",
        f"log.every_steps={per_call}",
        f"checkpoint.every_steps={save_interval(steps, per_call)}",
        "checkpoint.resume=auto",
        "log.progress=false",
        "log.plot=false",
        "log.trackers=[jsonl]",
        "eval.samples.count=0",
    ]


def random_kill_step(steps: int, per_call: int) -> int:
    """A random step to kill the run at: from its first checkpoint to its last call but one."""
    return random.randint(save_interval(steps, per_call), steps - per_call)


def verify_resume(
    config: str | os.PathLike,
    steps: int | None = None,
    overrides: list[str] | None = None,
    imports: list[str] | None = None,
    workdir: str | os.PathLike | None = None,
) -> Verdict:
    """Train ``config`` for ``steps`` steps uninterrupted and killed-then-resumed; compare them."""
    from functrain.checkpoint import load_params, params_digest
    from functrain.config.load import load_config

    overrides, imports = list(overrides or []), list(imports or [])
    per_call = load_config(config, overrides).train.steps_per_call
    steps = steps or 8 * per_call
    if steps < 2 * per_call or steps % per_call:
        raise FunctrainError(
            f"--steps {steps} must be a multiple of train.steps_per_call={per_call} and at least "
            f"{2 * per_call} (a checkpoint, then steps to interrupt)"
        )
    fixed = overrides + checked_settings(steps, per_call)
    load_config(config, fixed)  # bad config: one line before any training starts
    kill_step = random_kill_step(steps, per_call)
    with tempfile.TemporaryDirectory(prefix="verify-resume-", dir=workdir) as tmp:
        uninterrupted, interrupted = Path(tmp) / "uninterrupted", Path(tmp) / "interrupted"
        _run(_train_command(str(config), uninterrupted, fixed, imports), "uninterrupted")
        killed_at = _kill_at(_train_command(str(config), interrupted, fixed, imports, kill_step), interrupted)
        resumed_from = max(_committed(interrupted))
        reference = logged_training(uninterrupted)
        before_kill = {step: line for step, line in logged_training(interrupted).items() if step <= resumed_from}
        difference = first_difference({s: reference[s] for s in before_kill if s in reference}, before_kill)
        if difference is not None:  # not even reproducible without a resume: no need to resume to know
            return Verdict(
                False,
                steps,
                killed_at,
                resumed_from,
                f"{difference} (before the interruption: the run is not reproducible even without a resume)",
                ("-", "-"),
            )
        _run(_train_command(str(config), interrupted, fixed, imports), "resumed")
        digests = (params_digest(load_params(uninterrupted)), params_digest(load_params(interrupted)))
        difference = first_difference(reference, logged_training(interrupted))
    if difference is None and digests[0] != digests[1]:
        difference = "the final params (every logged metric agrees: look at steps between logs)"
    return Verdict(difference is None, steps, killed_at, resumed_from, difference, digests)


# ------------------------------------------------------------------------------------------ the verb

HELP = "kill + resume == uninterrupted? (PASS/FAIL)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--steps", type=int, default=None, help="steps to train (default 8 calls)")
    parser.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE in the training processes first (registers models or datasets)",
    )


def run(args: argparse.Namespace) -> int:
    verdict = verify_resume(args.config, args.steps, args.overrides, args.imports)
    print(verdict.report())
    return 0 if verdict.passed else 1
