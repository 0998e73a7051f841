"""``functrain convert hf-to-functrain HF_DIR RUN_DIR`` / ``functrain-to-hf RUN_DIR OUT_DIR [--step N]``."""

import argparse

from functrain.errors import TORCH_INSTALL, FunctrainError

HELP = "HF-style checkpoints <-> functrain run directories"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True)
    to_functrain = directions.add_parser("hf-to-functrain", help="HF dir -> a step-0 checkpoint to train from")
    to_functrain.add_argument("hf_dir")
    to_functrain.add_argument("run_dir")
    to_hf = directions.add_parser("functrain-to-hf", help="run dir -> config.json + safetensors")
    to_hf.add_argument("run_dir")
    to_hf.add_argument("out_dir")
    to_hf.add_argument("--step", type=int, default=None)
    to_hf.add_argument(
        "--merge-lora", action="store_true", help="a LoRA run: write merged weights (default: a PEFT adapter directory)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from torch_bridge.hf import convert
    except ImportError as exc:
        raise FunctrainError(
            f"conversion needs PyTorch and safetensors ({exc.__cause__ or exc}); {TORCH_INSTALL}, then pip "
            f"install 'functrain[hf]'"
        ) from None
    if args.direction == "hf-to-functrain":
        step = convert.hf_to_run_dir(args.hf_dir, args.run_dir)
        print(
            f"functrain: wrote checkpoint step {step} to {args.run_dir}; fine-tune with "
            f"functrain train {args.run_dir}/config.yaml"
        )
    else:
        out = convert.run_dir_to_hf(args.run_dir, args.out_dir, args.step, merge_lora=args.merge_lora)
        print(f"functrain: wrote {out}")
    return 0
