"""``functrain plot RUN_DIR... [-o FILE.png]``: the curves of one or several runs in one PNG."""

import argparse

HELP = "loss, learning rate, grad norm, throughput of runs in one PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument(
        "-o",
        "--output",
        default=None,
        help="PNG file, or a directory to write plot.png in (default RUN_DIR/plot.png; ./plot.png for several runs)",
    )


def run(args: argparse.Namespace) -> int:
    from functrain.report.plots import default_output, plot_runs

    print(f"functrain: wrote {plot_runs(args.run_dirs, args.output or default_output(args.run_dirs))}")
    return 0
