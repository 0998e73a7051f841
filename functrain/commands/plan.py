"""``functrain plan CONFIG [--topology NAME] [key=value ...] [--json]``: compile the run's train call ahead of
time (for the local devices, or a TPU topology through libtpu) and print per-chip memory, FLOPs, a roofline step
time, the MFU it implies and whether it fits (see :mod:`functrain.run.plan`)."""

import argparse
import json

HELP = "compile a run ahead of time: per-chip memory, step time and MFU, fits? (--topology v5p:4x4x8)"

GIB = 2 ** 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument("--topology", default=None, help="TPU topology to compile for, e.g. v5p:4x4x8 "
                                                         "(needs libtpu: pip install 'functrain[tpu]')")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def format_plan(plan) -> str:
    """The plan as the lines ``functrain plan`` prints."""
    from functrain.parallel.sharding import human_bytes
    sizes = plan.per_chip_bytes
    mesh = " ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [f"{plan.chips} x {plan.device_kind} (mesh {mesh}); {plan.parameters:,} parameters; batch "
             f"{plan.global_batch_size} x {plan.seq_len} tokens in {plan.micro_batches} micro-batch(es)",
             "per chip:"]
    lines += [f"  {name:<12}{human_bytes(sizes[name]):>12}" for name in ("params", "optimizer", "model_state", "batch",
                                                                "activations")]
    hbm = f" of {plan.hbm_bytes / GIB:.2f} GiB HBM" if plan.hbm_bytes else " (HBM of this device kind unknown)"
    lines.append(f"  {'total':<12}{human_bytes(sizes['total']):>12}{hbm}")
    lines.append(f"FLOPs per step per chip {plan.flops_per_step:.3e}; HBM bytes accessed {plan.bytes_per_step:.3e}")
    if plan.step_time_s is not None:
        throughput = (f", {plan.tokens_per_sec_per_chip:,.0f} tokens/s/chip" if plan.tokens_per_sec_per_chip
                      else "")
        lines.append(f"roofline step time {plan.step_time_s * 1e3:.1f} ms; MFU {plan.mfu:.1%}{throughput}")
    if plan.fits is None:
        lines.append("fits: unknown (no HBM figure for this device kind)")
    elif plan.fits:
        lines.append("fits: yes")
    else:
        over = sizes["total"] - plan.hbm_bytes
        lines.append(f"fits: no, {over / GIB:.2f} GiB over; " + "; or ".join(plan.advice))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from functrain.run.config import load_config
    from functrain.run.plan import plan
    result = plan(load_config(args.config, args.overrides), args.topology)
    print(json.dumps(result.to_json()) if args.json else format_plan(result))
    return 0
