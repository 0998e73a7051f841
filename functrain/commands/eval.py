"""``functrain eval RUN_DIR --tasks T1,T2``: score a language-model run with lm-evaluation-harness tasks.

The run's checkpoint (``--step``, default the newest whole one) is wrapped as lm-eval's ``functrain`` model
(:mod:`functrain.text.harness`); ``--include-path`` adds a folder of task YAMLs as ``lm_eval --include_path``
does. The scores are printed as lm-eval's table; ``--output FILE.json`` writes lm-eval's own results object
(``results`` per task and metric, ``configs``, ... and ``samples`` with ``--log-samples``), serialised as
``lm_eval`` writes it.
"""

import argparse
import json
import os
from pathlib import Path

HELP = "score a language-model run with lm-evaluation-harness tasks"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task (or group) names")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: UTF-8 bytes)")
    parser.add_argument("--include-path", default=None, help="a folder of extra task YAMLs (lm_eval --include_path)")
    parser.add_argument(
        "--limit", type=float, default=None, help="at most N documents per task (a fraction of them when below 1)"
    )
    parser.add_argument("--batch-size", type=int, default=None, help="requests per forward pass (default 16)")
    parser.add_argument("--output", default=None, help="write lm-eval's results object to this JSON file")
    parser.add_argument("--log-samples", action="store_true", help="keep every request's output in the JSON")


def _write_json(results: dict, path: Path) -> None:
    """``results`` as lm-eval's CLI serialises them, written whole or not at all."""
    from lm_eval.utils import handle_non_serializable

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    tmp.replace(path)


def run(args: argparse.Namespace) -> int:
    from functrain.errors import ConfigError

    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if args.limit is not None and not args.limit > 0:
        raise ConfigError(f"--limit {args.limit:g} must be above 0 (a count, or a fraction below 1)")
    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be at least 1")
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    from functrain.text.harness import FunctrainLM, evaluate_tasks, task_manager

    lm = FunctrainLM(run=args.run_dir, step=args.step, tokenizer=args.tokenizer, batch_size=args.batch_size)
    manager = task_manager(tasks, args.include_path)
    results = evaluate_tasks(lm, tasks, manager, limit=limit, log_samples=args.log_samples)
    model_args = {"run": args.run_dir, "step": lm.step, "tokenizer": args.tokenizer}
    results["config"].update(
        model="functrain",
        model_args=",".join(f"{key}={value}" for key, value in model_args.items() if value is not None),
        batch_size=lm.batch_size,
    )
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        _write_json(results, Path(args.output))
        print(f"wrote {args.output}")
    return 0
