"""The ``functrain`` command line: one module per verb beside this one, dispatched from here.

Bad input (configs, data, checkpoints, HF directories) prints one line naming the problem and the fix and
exits with status 2; ``--debug`` shows the traceback instead. ``train`` exits 0 when the run finished, and
with the statuses listed in :mod:`functrain.callbacks.outcome` when it stopped early or barely trained.
"""

import argparse
import contextlib
import importlib
import logging
import sys
from typing import Any, NoReturn

from functrain.errors import EXIT_BAD_INPUT, EXIT_SIGNAL, FunctrainError, user_code_failure
from functrain.guards.signals import (
    CommandSignals,
    Interrupted,
    announce_interrupted,
    check_interrupted,
    interrupted_by,
)
from functrain.report.console import RUN_LOGGER, add_stderr_handler

# The verbs, in the order `functrain --help` lists them; each module has HELP, add_arguments() and run().
VERBS = {
    "train": "train",
    "inspect": "inspect",
    "convert": "convert",
    "plot": "plot",
    "generate": "generate",
    "rewind": "rewind",
    "verify-resume": "verify_resume",
    "tokenize": "tokenize",
    "plan": "plan",
    "eval": "eval",
}
# Verbs whose trailing key=value words are config overrides.
TAKES_OVERRIDES = ("train", "rewind", "verify-resume", "plan")
# Verbs that train in this process, and so take stop signals from their first instant.
TRAINS = ("train", "rewind")


def _verb(name: str) -> Any:
    return importlib.import_module(f"functrain.commands.{VERBS[name]}")


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors in one line naming the argument, as every other bad input is (argparse prints its
    usage block first); ``--help`` still shows the usage. The verbs' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="functrain", description=f"functrain: {', '.join(VERBS)}.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in VERBS:
        verb = _verb(name)
        verb.add_arguments(commands.add_parser(name, help=verb.HELP))
    return parser


def _configure_logging(debug: bool) -> None:
    add_stderr_handler(logging.getLogger(RUN_LOGGER))
    # Orbax logs every save step through absl at INFO; keep the console for the run's own lines.
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass
    if not debug:  # one line per error: no tracebacks from Orbax's background threads
        from functrain.report.noise import silence_background_tracebacks

        silence_background_tracebacks()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``functrain`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((arg for arg in argv if not arg.startswith("-")), None)
    # A training command owns SIGTERM/SIGINT from here on, before JAX is even imported (see CommandSignals).
    with CommandSignals() if verb in TRAINS else contextlib.nullcontext():
        try:
            return _run(argv)
        except Interrupted as exc:
            announce_interrupted(str(exc))
            return EXIT_SIGNAL
        except Exception:
            # A stop signal came first and its Interrupted surfaced as another error (raised inside a JAX host
            # callback, it reaches us as a JaxRuntimeError): the signal is the outcome.
            signal_name = interrupted_by()
            if signal_name is None:
                raise
            announce_interrupted(signal_name)
            return EXIT_SIGNAL


def _run(argv: list[str]) -> int:
    # --debug may come anywhere (`functrain train cfg.yaml --debug` too).
    debug = "--debug" in argv
    argv = [arg for arg in argv if arg != "--debug"]
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    args.debug = debug
    # `train CFG --processes 2 key=value`: overrides after a flag land in `extra`; anything else is an error.
    if args.command in TAKES_OVERRIDES and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.debug)
    try:
        args.argv = argv  # `train --processes N` relaunches itself with the same words
        return _verb(args.command).run(args)
    except FunctrainError as exc:
        # A stop signal that code swallowed (a GC callback) came first: it is the outcome, not this error.
        check_interrupted()
        if args.debug:
            raise
        print(f"functrain: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:  # user code that failed during a run: its one line (functrain.run.failure)
        line = user_code_failure(exc)
        if line is None or args.debug:
            raise
        print(f"functrain: error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
