"""``functrain plan CONFIG [--topology NAME] [key=value ...] [--json]``: compile the run's train call ahead of
time (for the local devices, or a TPU topology through libtpu) and print per-chip memory, FLOPs, a roofline step
time, the MFU it implies and whether it fits (see :mod:`functrain.plan.planner`): one compile a plan."""

import argparse
import json

HELP = "compile a run ahead of time: per-chip memory, step time and MFU, fits? (--topology v5p:4x4x8)"

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted config overrides")
    parser.add_argument(
        "--topology",
        default=None,
        help="TPU topology to compile for, e.g. v5p:4x4x8 (needs libtpu: pip install 'functrain[tpu]')",
    )
    parser.add_argument(
        "--slices",
        type=int,
        default=None,
        help="compile for N slices of the topology joined over the data-centre network (DCN), spanned by "
        "mesh.dcn_data x mesh.dcn_fsdp x mesh.dcn_pipeline; reports the bytes each chip sends over DCN per step",
    )
    parser.add_argument(
        "--dcn-gbps",
        type=float,
        default=None,
        help="DCN bandwidth per chip in Gbit/s for the DCN time (default 50: TPU v5p's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--search",
        action="store_true",
        help="compile candidates: the cheapest model.remat that fits, then the largest per-chip batch",
    )


def format_plan(plan) -> str:
    """The plan as the lines ``functrain plan`` prints."""
    from functrain.parallel.sharding import human_bytes

    sizes = plan.per_chip_bytes
    quantized = plan.quantized_base_bytes is not None
    mesh = " ".join(f"{axis}={size}" for axis, size in plan.mesh.items())
    lines = [
        f"{plan.chips} x {plan.device_kind} (mesh {mesh}); {plan.parameters:,} parameters; batch "
        f"{plan.global_batch_size} x {plan.seq_len} tokens in {plan.micro_batches} micro-batch(es)"
        + (f"; {plan.attention} attention" if plan.attention else "")
        + (f"; experts: {plan.experts}" if plan.experts else ""),
        "per chip:",
    ]
    lines += [
        f"  {name:<12}{human_bytes(sizes[name]):>12}"
        + (f"  (quantized base {human_bytes(plan.quantized_base_bytes)})" if name == "params" and quantized else "")
        for name in ("params", "optimizer", "model_state", "batch", "activations")
    ]
    hbm = f" of {plan.hbm_bytes / GIB:.2f} GiB HBM" if plan.hbm_bytes else " (HBM of this device kind unknown)"
    lines.append(f"  {'total':<12}{human_bytes(sizes['total']):>12}{hbm}")
    if plan.compiled:
        scanned = " (scanned layers: every iteration of the loop counted)" if plan.layers_scanned else ""
        lines.append(
            f"FLOPs per step per chip {plan.flops_per_step:.3e}; HBM bytes accessed {plan.bytes_per_step:.3e}{scanned}"
        )
    else:
        lines.append("FLOPs and step time unknown: the compiler refused a program larger than HBM")
    if plan.pipeline_bubble is not None:
        lines.append(
            f"pipeline: {plan.mesh['pipeline']} stages x {plan.pipeline_repeats} repeat(s), "
            f"{plan.pipeline_microbatches} micro-batches; bubble {plan.pipeline_bubble:.1%} of each stage's time"
        )
    if plan.dcn_bytes_per_step is not None:
        hides = {True: "hides under", False: "exceeds", None: "compare with"}[plan.dcn_hidden]
        lines.append(
            f"DCN ({plan.slices} slices): {human_bytes(plan.dcn_bytes_per_step)} per chip per step, "
            f"{plan.dcn_time_s * 1e3:.1f} ms at {plan.dcn_gbps:g} Gbit/s; {hides} the step's compute"
        )
    if plan.step_time_s is not None:
        throughput = f", {plan.tokens_per_sec_per_chip:,.0f} tokens/s/chip" if plan.tokens_per_sec_per_chip else ""
        lines.append(f"roofline step time {plan.step_time_s * 1e3:.1f} ms; MFU {plan.mfu:.1%}{throughput}")
    if plan.fits is None:
        lines.append("fits: unknown (no HBM figure for this device kind)")
    elif plan.fits:
        lines.append("fits: yes")
    else:
        from functrain.plan.planner import HBM_USABLE

        over = sizes["total"] - HBM_USABLE * plan.hbm_bytes
        lines.append(
            f"fits: no, {over / GIB:.2f} GiB over the {HBM_USABLE:.0%} of HBM a run can use; "
            + "; or ".join(plan.advice)
        )
    return "\n".join(lines)


def format_search(tried, chosen) -> str:
    """The candidates ``plan --search`` compiled, one row each, and the choice."""
    from functrain.parallel.sharding import human_bytes

    lines = [
        (
            f"{'model.remat':<14}{'global batch':>13}{'per chip':>10}{'total/chip':>13}{'fits':>6}{'step ms':>9}"
            f"{'MFU':>7}"
        )
    ]
    for candidate in tried:
        result = candidate.plan
        step = f"{result.step_time_s * 1e3:.1f}" if result.step_time_s is not None else "-"
        mfu = f"{result.mfu:.1%}" if result.mfu is not None else "-"
        fits = {True: "yes", False: "no", None: "?"}[result.fits]
        lines.append(
            f"{candidate.remat or '-':<14}{candidate.global_batch_size:>13}{candidate.per_chip_batch:>10g}"
            f"{human_bytes(result.per_chip_bytes['total']):>13}{fits:>6}{step:>9}{mfu:>7}"
        )
    if chosen is None:
        lines.append("nothing fits (or the chips' HBM is unknown): see functrain plan without --search for advice")
    else:
        remat = f"model.remat={chosen.remat} " if chosen.remat else ""
        lines.append(f"choose: {remat}data.global_batch_size={chosen.global_batch_size}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from functrain.config.load import load_config
    from functrain.plan.planner import DEFAULT_DCN_GBPS, plan

    config = load_config(args.config, args.overrides)
    if args.search:
        from functrain.commands.plan_search import search

        tried, chosen = search(config, args.topology, args.slices)
        record = {
            "tried": [dict(remat=c.remat, global_batch_size=c.global_batch_size, plan=c.plan.to_json()) for c in tried],
            "chosen": None
            if chosen is None
            else {"remat": chosen.remat, "global_batch_size": chosen.global_batch_size},
        }
        print(json.dumps(record) if args.json else format_search(tried, chosen))
        return 0
    result = plan(config, args.topology, args.slices, DEFAULT_DCN_GBPS if args.dcn_gbps is None else args.dcn_gbps)
    print(json.dumps(result.to_json()) if args.json else format_plan(result))
    return 0
