"""``functrain plan`` before and after issue 51: the figures each plan reports and the time it takes, for the shipped
configs on their TPU topologies.

Before, a plan compiled the run's train call for memory and then copies of the run to count its FLOPs and bytes
(unrolled with one and two groups of layers and the cross-entropy's chunks, with libtpu's collective matmuls off,
again on split micro-batches where libtpu refused a copy for HBM). Now the one compiled program is counted with its
loops unrolled in its HLO (``functrain/plan/counting.py``). Each case runs ``functrain plan --json`` in a fresh
process on the code of ``--before`` (a git worktree of that commit, made and removed here), then on this checkout's
(or ``--after``'s, a worktree too: edits made while a long run goes on stay out of it), back to back, so that both
see the same load; the ratios are new / old. Results are kept in ``--out`` as each case
finishes (a case already there is not run again).

Usage: python bench/bench_plan.py                       # the issue's three targets
       python bench/bench_plan.py --cases all --out /tmp/bench_plan.json
       python bench/bench_plan.py --cases 350m,mixtral --before main
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The last commit of main before the change.
BEFORE = "0d370ae"
# name -> (config, topology, slices, overrides)
CASES: dict[str, tuple[str, str, int, list[str]]] = {
    "maxtext-8b": ("configs/llama3_8b.yaml", "v5p:2x2x1", 1,
                   ["data.seq_len=2048", "data.global_batch_size=4", "train.micro_batches=1", "mesh.fsdp=4"]),
    "8b": ("configs/llama3_8b.yaml", "v5p:2x2x2", 1, []),
    "70b-two-slices": ("configs/llama3_70b.yaml", "v5p:4x4x2", 2, ["mesh.dcn_fsdp=2", "data.global_batch_size=128"]),
    "8b-pipeline": ("configs/llama3_8b.yaml", "v5p:2x2x2", 1, ["mesh.pipeline=2"]),
    "350m": ("configs/gpt_350m.yaml", "v5p:2x2x2", 1,
             ["data.name=synthetic", "data.global_batch_size=64", "mesh.fsdp=8", "mesh.data=1"]),
    "qwen3-30b-a3b": ("configs/qwen3_30b_a3b.yaml", "v5p:4x4x4", 1, []),
    "128k": ("configs/llama3_8b_128k.yaml", "v5p:4x4x4", 1, []),
    "mixtral": ("configs/mixtral_8x7b.yaml", "v5p:4x4x8", 1, []),
    "70b": ("configs/llama2_70b.yaml", "v5p:8x8x8", 1, []),
    "405b": ("configs/llama3_405b.yaml", "v5p:8x8x4", 2, []),
}
TARGETS = ("maxtext-8b", "8b", "70b-two-slices")


def plan(tree: Path, case: str) -> dict:
    """``functrain plan --json`` of ``case`` run from ``tree``: its report, wall and CPU seconds."""
    config, topology, slices, overrides = CASES[case]
    command = [sys.executable, "-m", "functrain", "plan", config, "--topology", topology, "--json", *overrides]
    command += ["--slices", str(slices)] if slices > 1 else []
    env = {key: value for key, value in os.environ.items() if not key.startswith("JAX_COMPILATION_CACHE")}
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed in {tree}:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"report": report, "wall_s": wall, "cpu_s": used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime}


def worktree(commit: str) -> Path:
    """A git worktree of ``commit`` in a new temporary directory."""
    tree = Path(tempfile.mkdtemp(prefix="bench-plan-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), commit], cwd=REPO, check=True, capture_output=True)
    return tree


def ratio(new: float | None, old: float | None) -> str:
    return "-" if not new or not old else f"{new / old:.4f}"


def row(case: str, old: dict, new: dict) -> str:
    """One line of the table: times, their ratio, and the figures new / old."""
    before, after = old["report"], new["report"]
    same_memory = before["per_chip_bytes"] == after["per_chip_bytes"]
    mfu = " -> ".join("-" if r["mfu"] is None else f"{r['mfu']:.1%}" for r in (before, after))
    return (f"| {case} | {old['wall_s']:.0f} s / {old['cpu_s']:.0f} s | {new['wall_s']:.0f} s / {new['cpu_s']:.0f} s"
            f" | {old['wall_s'] / new['wall_s']:.2f}x | {ratio(after['flops_per_step'], before['flops_per_step'])}"
            f" | {ratio(after['bytes_per_step'], before['bytes_per_step'])}"
            f" | {ratio(after['dcn_bytes_per_step'], before['dcn_bytes_per_step'])}"
            f" | {'yes' if same_memory else 'NO'} | {mfu} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(TARGETS), help=f"comma-separated, or all: {', '.join(CASES)}")
    parser.add_argument("--before", default=BEFORE, help="the git commit whose plan is the baseline")
    parser.add_argument("--after", default=None, help="the git commit planned as new (default: this checkout)")
    parser.add_argument("--out", default=None, help="JSON file the results are kept in (and read from)")
    args = parser.parse_args()
    cases = list(CASES) if args.cases == "all" else args.cases.split(",")
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    out = Path(args.out) if args.out else None
    results = json.loads(out.read_text()) if out and out.exists() else {}
    trees = {"before": worktree(args.before), "after": worktree(args.after) if args.after else REPO}
    print("| case | before: wall / CPU | after: wall / CPU | faster | FLOPs new/old | bytes new/old | DCN new/old |"
          " memory same | MFU before -> after |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    try:
        for case in cases:
            if case not in results:
                results[case] = {"old": plan(trees["before"], case), "new": plan(trees["after"], case)}
                if out:
                    out.write_text(json.dumps(results, indent=1))
            print(row(case, results[case]["old"], results[case]["new"]), flush=True)
    finally:
        for tree in trees.values():
            if tree != REPO:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)


if __name__ == "__main__":
    main()
