"""The ``functrain`` command line: train, inspect, convert, plot, generate, rewind, verify-resume, tokenize.

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
    parser = argparse.ArgumentParser(prog="functrain",
                                     description="functrain: train, inspect, convert, plot, generate, tokenize.")
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
    to_hf.add_argument("--merge-lora", action="store_true",
                       help="a LoRA run: write merged weights (default: a PEFT adapter directory)")

    plot = commands.add_parser("plot", help="loss, learning rate, grad norm, throughput of runs in one PNG")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    plot.add_argument("-o", "--output", default=None, help="PNG path (default RUN_DIR/plot.png for one run, "
                                                             "./plot.png for several)")

    generate = commands.add_parser("generate", help="continue a prompt with a language-model run")
    generate.add_argument("run_dir")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    generate.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: UTF-8 bytes)")

    rewind = commands.add_parser("rewind", help="resume from checkpoint STEP skipping the next K samples")
    rewind.add_argument("run_dir")
    rewind.add_argument("--to", type=int, required=True, metavar="STEP", help="checkpoint step to go back to")
    rewind.add_argument("--skip-samples", type=int, required=True, metavar="K", help="samples to step over")
    rewind.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")

    verify = commands.add_parser("verify-resume", help="kill + resume == uninterrupted? (PASS/FAIL)")
    verify.add_argument("config")
    verify.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    verify.add_argument("--steps", type=int, default=None, help="steps to train (default 8 calls)")
    verify.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="import MODULE in the training processes first (registers models or datasets)")
    tokenize = commands.add_parser("tokenize", help="text / jsonl / parquet / HF dataset -> a token store")
    tokenize.add_argument("inputs", nargs="+", metavar="INPUT", help="files (or saved HF datasets) to tokenize")
    tokenize.add_argument("out", metavar="OUT_STORE", help="the store directory to create")
    tokenize.add_argument("--tokenizer", default=None,
                          help="tokenizer.json or transformers tokenizer directory (default: UTF-8 bytes)")
    tokenize.add_argument("--workers", type=int, default=None, help="encoding processes (default: all cores)")
    tokenize.add_argument("--field", default="text", help="JSON field / column holding the text (default: text)")
    tokenize.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard file (default 2^30)")
    return parser


def _configure_logging(debug: bool) -> None:
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
    if not debug:  # one line per error: no tracebacks from Orbax's background threads
        from functrain.checkpoint.noise import silence_background_tracebacks
        silence_background_tracebacks()


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


def _plot(args: argparse.Namespace) -> int:
    from functrain.plot import default_output, plot_runs
    print(f"functrain: wrote {plot_runs(args.run_dirs, args.output or default_output(args.run_dirs))}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from functrain.generate import Sampling, load_language_model, load_tokenizer, sample_text
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    model, params, _ = load_language_model(args.run_dir, args.step)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + sample_text(model, params, args.prompt, sampling, tokenizer))
    return 0


def _rewind(args: argparse.Namespace) -> int:
    from functrain.rewind import rewind
    result = rewind(args.run_dir, args.to, args.skip_samples, args.overrides)
    print(f"functrain: rewound to step {args.to}, skipped {args.skip_samples} samples; {result.stop_reason} at "
          f"step {result.step}; run directory {result.run_dir}")
    return result.exit_code


def _verify_resume(args: argparse.Namespace) -> int:
    from functrain.verify_resume import verify_resume
    verdict = verify_resume(args.config, args.steps, args.overrides, args.imports)
    print(verdict.report())
    return 0 if verdict.passed else 1


def _tokenize(args: argparse.Namespace) -> int:
    from functrain.data.token_store import DEFAULT_SHARD_TOKENS
    from functrain.tokenize_job import tokenize_files
    for flag, value in (("--workers", args.workers), ("--shard-tokens", args.shard_tokens)):
        if value is not None and value < 1:
            raise FunctrainError(f"{flag} {value} must be at least 1")
    manifest = tokenize_files(args.inputs, args.out, args.tokenizer, args.workers, args.field,
                              args.shard_tokens or DEFAULT_SHARD_TOKENS)
    print(f"functrain: wrote {args.out}: {manifest['num_docs']} documents, {manifest['num_tokens']} tokens "
          f"({manifest['dtype']}, vocab {manifest['vocab_size']}, tokenizer {manifest['tokenizer']['name']})")
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
        out = convert.run_dir_to_hf(args.run_dir, args.out_dir, args.step, merge_lora=args.merge_lora)
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
    takes_overrides = args.command in ("train", "rewind", "verify-resume")
    if takes_overrides and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _configure_logging(args.debug)
    try:
        if args.command == "train":
            return _train(args, argv)
        commands = {"inspect": _inspect, "convert": _convert, "plot": _plot, "generate": _generate,
                    "rewind": _rewind, "verify-resume": _verify_resume, "tokenize": _tokenize}
        return commands[args.command](args)
    except FunctrainError as exc:
        if args.debug:
            raise
        print(f"functrain: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
