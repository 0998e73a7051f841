"""Restart benchmark: what the persistent compilation cache saves a restart, and local against persistent saves.

1. Restart to first step, with the compilation cache against without it: a run of CONFIG trains one step and
   saves (with a fresh cache directory, which it fills); then restarts of the same run, each training one more
   step, alternate between ``run.compile_cache=<that directory>`` and ``run.compile_cache=null`` (ABAB, so load
   from other processes hits both alike). A restart's time to its first step is read from its own events: from
   its process start to its ``end`` event, less the final save (the step is finished by then: its metrics were
   read). The schedule is constant so that a longer ``train.max_steps`` leaves the program unchanged, as a
   restart after a preemption does.
2. Saving one state: ``LocalCheckpoints`` (this process's shards, one file) to the same disk and to /dev/shm
   against ``Checkpointer`` (Orbax, async) to the same disk: the time the training thread is blocked and the
   time to a committed step, best of N.

Usage: python bench/bench_restart.py --config configs/char_gpt.yaml --pairs 3 [key=value ...]
       python bench/bench_restart.py --config configs/gpt_350m.yaml --pairs 1 data.global_batch_size=1 data.seq_len=64
       python bench/bench_restart.py --saves-only --width 2048 --layers 6
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUIET = ["log.progress=false", "log.tensorboard=false", "log.plot=false", "eval.every_steps=0", "eval.samples.count=0",
         "data.eval_fraction=0", "train.steps_per_call=1", "log.every_steps=1", "checkpoint.every_steps=0",
         "optimizer.schedule=constant", "optimizer.warmup_steps=0", "train.epochs=null"]


def train(config: str, run_dir: Path, steps: int, cache: str, extra: list[str]) -> dict:
    """Run ``functrain train`` to ``steps``; return its last session's start and end events."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    command = [sys.executable, "-m", "functrain", "train", config, f"run.dir={run_dir}", f"train.max_steps={steps}",
               f"run.compile_cache={cache}", *QUIET, *extra]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"training failed:\n{proc.stderr[-3000:]}")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    begin = [e for e in events if e["event"] in ("start", "resume")][-1]
    end = events[-1]
    assert end["event"] == "end" and end["step"] == steps, end
    seconds = end["seconds"]
    to_first_step = end["time"] - begin["session_started"] - seconds.get("save", 0.0) - seconds.get("eval", 0.0)
    hit = "compilation cache hit" in proc.stderr
    return {"to_first_step": to_first_step, "compile": seconds.get("compile", 0.0), "hit": hit}


def restarts(config: str, pairs: int, extra: list[str]) -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    try:
        cache, run_dir = root / "cache", root / "run"
        first = train(config, run_dir, 1, str(cache), extra)
        print(f"{config}: first start {first['to_first_step']:.1f}s to its first step ({first['compile']:.1f}s compiling)")
        rows: dict[str, list[dict]] = {"cache": [], "none": []}
        step = 1
        for _ in range(pairs):
            for variant in ("cache", "none"):
                step += 1
                rows[variant].append(train(config, run_dir, step, str(cache) if variant == "cache" else "null", extra))
        assert all(r["hit"] for r in rows["cache"]) and not any(r["hit"] for r in rows["none"])
        cached = statistics.median(r["to_first_step"] for r in rows["cache"])
        uncached = statistics.median(r["to_first_step"] for r in rows["none"])
        compile_cached = statistics.median(r["compile"] for r in rows["cache"])
        compile_uncached = statistics.median(r["compile"] for r in rows["none"])
        print(f"restart to first step (median of {pairs}): with cache {cached:.1f}s, without {uncached:.1f}s: "
              f"{uncached / cached:.2f}x faster with it; compiling {compile_cached:.1f}s against {compile_uncached:.1f}s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def saves(width: int, layers: int, repeats: int) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from functrain.checkpoint import Checkpointer
    from functrain.checkpoint.local import LocalCheckpoints

    key = jax.random.PRNGKey(0)
    params = {f"layer{i}": {"kernel": jax.random.normal(jax.random.fold_in(key, i), (width, width)),
                            "bias": jnp.zeros((width,))} for i in range(layers)}
    items = {"params": params, "state": {"opt_state": optax.adamw(1e-3).init(params)}}
    size = sum(leaf.nbytes for leaf in jax.tree.leaves(items))
    disk = Path(tempfile.mkdtemp(prefix="bench-saves-", dir=os.environ.get("BENCH_DIR")))
    shm = Path(tempfile.mkdtemp(prefix="bench-saves-", dir="/dev/shm"))
    results: dict[str, list[tuple[float, float]]] = {"persistent": [], "local (disk)": [], "local (/dev/shm)": []}
    try:
        persistent = Checkpointer(disk / "run", keep=1)
        local_disk = LocalCheckpoints(disk / "local", disk / "run", keep=1, history=lambda: 1.0)
        local_shm = LocalCheckpoints(shm, disk / "run", keep=1, history=lambda: 1.0)
        for step in range(1, repeats + 1):  # the three in turn, so that load hits them alike
            for name, save, wait in (
                ("persistent", lambda s: persistent.save(s, items, {}), persistent.wait),
                ("local (disk)", lambda s: local_disk.save(s, items, {}), local_disk.wait),
                ("local (/dev/shm)", lambda s: local_shm.save(s, items, {}), local_shm.wait),
            ):
                started = time.perf_counter()
                save(step)
                blocked = time.perf_counter() - started
                wait()
                results[name].append((blocked, time.perf_counter() - started))
        persistent.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    base_blocked, base_total = (min(values) for values in zip(*results["persistent"]))
    print(f"saving {size / 2**20:.0f} MiB (params + AdamW state), best of {repeats}:")
    for name, timings in results.items():
        blocked, total = (min(values) for values in zip(*timings))
        print(f"  {name:<17} blocked {blocked:6.3f}s ({blocked / base_blocked:4.2f}x persistent), "
              f"committed {total:6.3f}s ({total / base_total:4.2f}x persistent)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/char_gpt.yaml")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--saves-only", action="store_true")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    args, extra = parser.parse_known_args()
    if not args.saves_only:
        restarts(args.config, args.pairs, extra)
    saves(args.width, args.layers, args.repeats)


if __name__ == "__main__":
    main()
