"""``functrain convert hf-to-functrain HF_DIR RUN_DIR [--base-dtype nf4|int8]`` / ``functrain-to-hf RUN_DIR OUT_DIR
[--step N] [--merge-lora]``."""

import argparse
from typing import Any

import pydantic

from functrain.errors import TORCH_INSTALL, ConfigError, FunctrainError

HELP = "HF-style checkpoints <-> functrain run directories"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    directions = parser.add_subparsers(dest="direction", required=True)
    to_functrain = directions.add_parser("hf-to-functrain", help="HF dir -> a step-0 checkpoint to train from")
    to_functrain.add_argument("hf_dir")
    to_functrain.add_argument("run_dir")
    to_functrain.add_argument(
        "--base-dtype", choices=("nf4", "int8"), help="store the Dense kernels quantized: a QLoRA base (model.lora)"
    )
    to_functrain.add_argument("--block-size", type=int, help="nf4: weights per absmax scale (default 64)")
    to_functrain.add_argument(
        "--no-double-quant", action="store_true", help="nf4: keep the absmax scales in float32 (default: 8-bit)"
    )
    to_hf = directions.add_parser("functrain-to-hf", help="run dir -> config.json + safetensors")
    to_hf.add_argument("run_dir")
    to_hf.add_argument("out_dir")
    to_hf.add_argument("--step", type=int, default=None)
    to_hf.add_argument(
        "--merge-lora", action="store_true", help="a LoRA run: write merged weights (default: a PEFT adapter directory)"
    )


def quantized_base(args: argparse.Namespace) -> Any:
    """The ``model.lora`` section of the QLoRA base ``--base-dtype`` asks for (None: a float base); its options
    without it are a ConfigError."""
    from functrain.models.configs.lora import LoraConfig

    options = {"block_size": args.block_size, "double_quant": False if args.no_double_quant else None}
    given = {key: value for key, value in options.items() if value is not None}
    if args.base_dtype is None:
        if given:
            raise ConfigError("--block-size and --no-double-quant quantize an nf4 base; add --base-dtype nf4")
        return None
    try:
        return LoraConfig(base_dtype=args.base_dtype, **given)
    except pydantic.ValidationError as err:
        message = err.errors()[0]["msg"].removeprefix("Value error, ")
        raise ConfigError(f"--base-dtype {args.base_dtype}: {message}") from None


def run(args: argparse.Namespace) -> int:
    try:
        from torch_bridge.hf import convert
    except ImportError as exc:
        raise FunctrainError(
            f"conversion needs PyTorch and safetensors ({exc.__cause__ or exc}); {TORCH_INSTALL}, then pip "
            f"install 'functrain[hf]'"
        ) from None
    if args.direction == "hf-to-functrain":
        step = convert.hf_to_run_dir(args.hf_dir, args.run_dir, quantized_base(args))
        print(
            f"functrain: wrote checkpoint step {step} to {args.run_dir}; fine-tune with "
            f"functrain train {args.run_dir}/config.yaml"
        )
    else:
        out = convert.run_dir_to_hf(args.run_dir, args.out_dir, args.step, merge_lora=args.merge_lora)
        print(f"functrain: wrote {out}")
    return 0
