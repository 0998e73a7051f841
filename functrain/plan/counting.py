"""A step's FLOPs and HBM bytes, counted on the one program a plan compiles (the run's own train call).

XLA's ``cost_analysis()`` counts a loop body once, and the train call is loops: over ``train.steps_per_call``
steps, over ``train.micro_batches``, over the groups of a scanned model's layers (``model.scan_layers``), over
the cross-entropy's chunks (``train.logits_chunk``), over a pipeline's iterations, and on TPU over the shards of
each collective matmul (libtpu turns a matmul fed by an FSDP all-gather, or feeding a reduce-scatter, into a loop
that multiplies one shard while the next arrives). So the compiled program's HLO text is counted with every loop
unrolled (:func:`functrain.plan.hlo_loops.loops_unrolled`: each body called once per iteration) by XLA's own
cost analysis (``HloCostAnalysis``, the analysis ``jax.stages.Lowered.cost_analysis`` runs, here on the host's CPU
client: libtpu's compile-only client offers none), divided by ``steps_per_call``. Nothing is compiled again.

XLA's analysis does not see into a cuBLAS call (GPU programs run their matmuls as ``__cublas$gemm`` custom
calls): their FLOPs are added from their shapes (:func:`gemm_flops`). Nor into a Pallas kernel: the planner adds
splash attention's FLOPs (:func:`functrain.plan.planner.report`), and the kernels of ``COSTED_KERNELS`` (the gated
delta rule's forward and backward, :mod:`functrain.models.delta_rule_pallas`) are counted by the cost estimate they
carry in the HLO (:func:`kernel_flops`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from typing import Any

from jax.extend.backend import get_backend
from jaxlib import _jax, xla_client  # jaxlib's cost analysis, as jax.stages.Lowered.cost_analysis calls it

from functrain.plan.dcn import dcn_bytes
from functrain.plan.hlo_loops import Computation, Instruction, loops_unrolled, parse_program

COST_KEYS = ("flops", "bytes accessed")
# The cost entry of the bytes a chip sends over DCN in a step (step_cost).
DCN_KEY = "dcn bytes"

_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_DIMS = re.compile(r"\w+\[([\d,]*)\]")
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
# Pallas kernels whose FLOPs come from the cost estimate in their custom call (by the name they are called with).
COSTED_KERNELS = ("gated_delta_rule", "gated_delta_rule_backward")
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')
_KERNEL_NAME = re.compile(r'op_name="[^"]*\b(' + "|".join(COSTED_KERNELS) + r')/pallas_call"')


def step_cost(compiled: Any, steps_per_call: int, slices: int = 1) -> dict[str, float]:
    """FLOPs and HBM bytes (``COST_KEYS``) per chip of one step of a compiled train call of ``steps_per_call``
    steps, every loop counted (see the module), and the bytes a chip sends over DCN in a step (``dcn bytes``,
    :func:`functrain.plan.dcn.dcn_bytes`) when the call spans several ``slices``."""
    text = compiled.as_text() or ""
    program = parse_program(text)
    counted = hlo_cost(loops_unrolled(text, program))
    cublas = program.total(gemm_flops) if "__cublas$" in text else 0.0
    kernels = program.total(kernel_flops) if any(name in text for name in COSTED_KERNELS) else 0.0
    cost = {
        "flops": (float(counted.get("flops", 0.0)) + cublas + kernels) / steps_per_call,
        "bytes accessed": float(counted.get("bytes accessed", 0.0)) / steps_per_call,
    }
    if slices > 1:
        cost[DCN_KEY] = dcn_bytes(program, slices) / steps_per_call
    return cost


def hlo_cost(hlo_text: str) -> dict[str, float]:
    """XLA's cost analysis of a program given as HLO text (a loop body counted once)."""
    module = xla_client.hlo.hlo_module_from_text(hlo_text)
    return dict(_jax.hlo_module_cost_analysis(_cpu_client(), module))


@functools.cache
def _cpu_client() -> Any:
    """A CPU client for the analysis: JAX's own, or one of its own where the process started no CPU backend."""
    try:
        return get_backend("cpu")
    except RuntimeError:
        return xla_client.make_cpu_client()


def gemm_flops(computation: Computation, instruction: Instruction) -> float:
    """The FLOPs of a cuBLAS matmul custom call (2 x its output's elements x the contracted size), 0 for any other
    instruction."""
    line = instruction.line
    if "__cublas$" not in line or not _GEMM.search(line) or not instruction.operands:
        return 0.0
    lhs = computation.instructions.get(instruction.operands[0])
    contracting = _CONTRACTING.search(line)
    if lhs is None or contracting is None:
        return 0.0
    lhs_dims, output = _shape(lhs.line), _shape(line)
    axes = [int(axis) for axis in json.loads(f"[{contracting.group(1)}]")]
    return 2.0 * math.prod(output) * math.prod(lhs_dims[axis] for axis in axes if axis < len(lhs_dims))


def kernel_flops(computation: Computation, instruction: Instruction) -> float:
    """The FLOPs of a Pallas call of ``COSTED_KERNELS``, read from the cost estimate it was built with; 0 for any
    other instruction."""
    line = instruction.line
    if "custom-call" not in line or not _KERNEL_NAME.search(line):
        return 0.0
    found = _KERNEL_FLOPS.search(line)
    return float(found.group(1)) if found else 0.0


def _shape(line: str) -> list[int]:
    """The dimensions of an instruction's result (of its first element, for a tuple)."""
    found = _DIMS.search(line, line.index(" = ") + 3)
    return [int(dim) for dim in found.group(1).split(",") if dim] if found else []
