"""The ``functrain`` command line: train, inspect, convert.

Bad input (configs, data, checkpoints, HF directories) prints one line naming the problem and the fix and
exits with status 2; ``--debug`` shows the traceback instead. ``train`` exits 0 when the run finished, and
with the statuses listed in :mod:`functrain.outcome` when it stopped early or barely trained.
"""

import argparse
import logging
import sys

from functrain.errors import FunctrainError
from functrain.outcome import EXIT_BAD_INPUT


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="functrain", description="functrain: train, inspect, convert.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train (resumes from the run directory automatically)")
    train.add_argument("config", help="YAML config file (see configs/)")
    train.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    train.add_argument("--processes", type=int, default=1, help="start N local processes (gloo collectives)")
    train.add_argument("--port", type=int, default=None, help="coordinator port for --processes")

    inspect = commands.add_parser("inspect", help="checkpoints, validity, metrics of a run directory")
    inspect.add_argument("run_dir")
    inspect.add_argument("--step", type=int, default=None)
    inspect.add_argument("--digest", action="store_true", help="print the SHA-256 of the parameters")
    inspect.add_argument("--verify", action="store_true", help="read every array to find damaged checkpoints")

    convert = commands.add_parser("convert", help="HF-style checkpoints <-> functrain run directories")
    directions = convert.add_subparsers(dest="direction", required=True)
    to_functrain = directions.add_parser("hf-to-functrain", help="HF dir -> a step-0 checkpoint to train from")
    to_functrain.add_argument("hf_dir")
    to_functrain.add_argument("run_dir")
    to_hf = directions.add_parser("functrain-to-hf", help="run dir -> config.json + safetensors")
    to_hf.add_argument("run_dir")
    to_hf.add_argument("out_dir")
    to_hf.add_argument("--step", type=int, default=None)
    return parser


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    run_log = logging.getLogger("functrain")
    run_log.addHandler(handler)
    run_log.propagate = False  # absl installs its own root handler; print the run's lines once, plainly
    # Orbax logs every save step through absl at INFO; keep the console for the run's own lines.
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging
        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass
    run_log.setLevel(logging.INFO)


def _train(args: argparse.Namespace, argv: list[str]) -> int:
    from functrain import distributed
    if args.processes > 1:
        return distributed.launch_local(distributed.strip_processes_flag(argv), args.processes, args.port)
    distributed.initialize_from_env()
    from functrain.loop import fit
    from functrain.config import load_config
    result = fit(load_config(args.config, args.overrides))
    if distributed.is_primary():
        print(f"functrain: {result.stop_reason} at step {result.step}; run directory {result.run_dir}")
    return result.exit_code


def _inspect(args: argparse.Namespace) -> int:
    from functrain.inspect_run import inspect_report
    print(inspect_report(args.run_dir, step=args.step, digest=args.digest, verify=args.verify))
    return 0


def _convert(args: argparse.Namespace) -> int:
    try:
        from torch_bridge.hf import convert
    except ImportError as exc:
        raise FunctrainError(f"conversion needs PyTorch and safetensors ({exc}); pip install 'functrain[hf]'"
                             ) from None
    if args.direction == "hf-to-functrain":
        step = convert.hf_to_run_dir(args.hf_dir, args.run_dir)
        print(f"functrain: wrote checkpoint step {step} to {args.run_dir}; fine-tune with "
              f"functrain train {args.run_dir}/config.yaml")
    else:
        out = convert.run_dir_to_hf(args.run_dir, args.out_dir, args.step)
        print(f"functrain: wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``functrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug may come anywhere (`functrain train cfg.yaml --debug` too).
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.debug = debug
    # `train CFG --processes 2 key=value`: overrides after a flag land in `extra`; anything else is an error.
    if args.command == "train" and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging()
    try:
        if args.command == "train":
            return _train(args, argv)
        if args.command == "inspect":
            return _inspect(args)
        return _convert(args)
    except FunctrainError as exc:
        if args.debug:
            raise
        print(f"functrain: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
