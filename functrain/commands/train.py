"""``functrain train CONFIG [key=value ...]``: train (resumes from the run directory automatically)."""

import argparse

from functrain.errors import FunctrainError

HELP = "train (resumes from the run directory automatically)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--processes", type=int, default=1, help="start N local processes (gloo collectives)")
    parser.add_argument("--port", type=int, default=None, help="coordinator port for --processes")
    parser.add_argument(
        "--restarts", type=int, default=0, help="start a run that died again, up to N times, resuming each time"
    )
    parser.add_argument(
        "--restart-delay",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="pause before the first restart (doubling for each next one, up to 5 minutes)",
    )


def run(args: argparse.Namespace) -> int:
    if args.processes < 1:
        raise FunctrainError(f"--processes {args.processes} must be at least 1")
    if args.restarts < 0:
        raise FunctrainError(f"--restarts {args.restarts} must be 0 or more (how many times to restart a run)")
    if args.restart_delay < 0:
        raise FunctrainError(f"--restart-delay {args.restart_delay:g} must be 0 or more seconds")
    if args.restarts:
        from functrain.guards.restarts import run_with_restarts
        from functrain.parallel.launch_flags import without_flags

        argv = without_flags(args.argv, ("--restarts", "--restart-delay"))
        return run_with_restarts(argv + ["--debug"] * args.debug, args.restarts, args.restart_delay)
    if args.processes > 1:
        from functrain.parallel import launcher

        return launcher.launch_local(launcher.strip_processes_flag(args.argv), args.processes, args.port)
    from functrain.parallel import distributed

    distributed.initialize_from_env()
    from functrain.config.load import load_config
    from functrain.run.fit import fit

    result = fit(load_config(args.config, args.overrides))
    if distributed.is_primary():
        print(f"functrain: {result.stop_reason} at step {result.step}; run directory {result.run_dir}")
    return result.exit_code
