"""A step's FLOPs and HBM bytes, counted on the one program a plan compiles (the run's own train call).

XLA's ``cost_analysis()`` counts a loop body once, and the train call is loops: over ``train.steps_per_call``
steps, over ``train.micro_batches``, over the groups of a scanned model's layers (``model.scan_layers``), over
the cross-entropy's chunks (``train.logits_chunk``), over a pipeline's iterations, and on TPU over the shards of
each collective matmul (libtpu turns a matmul fed by an FSDP all-gather, or feeding a reduce-scatter, into a loop
that multiplies one shard while the next arrives). So the compiled program's HLO text is counted with every loop
unrolled (:func:`functrain.plan.hlo_loops.loops_unrolled`: each body called once per iteration) by XLA's own
cost analysis (``HloCostAnalysis``, the analysis ``jax.stages.Lowered.cost_analysis`` runs, here on the host's CPU
client: libtpu's compile-only client offers none), divided by ``steps_per_call``. Nothing is compiled again.

XLA's analysis counts a custom call as unknown (-1 FLOPs, -1 bytes); a kernel's is counted here instead
(:func:`kernel_cost`). A cuBLAS matmul (GPU programs run theirs as ``__cublas$gemm`` custom calls) by its shapes. A
TPU kernel by the cost estimate it carries in the HLO: libtpu's own grouped matmul for ``jax.lax.ragged_dot`` (a
mixture of experts' expert matmuls) and the Pallas kernels built with one (the gated delta rule's forward and
backward, :mod:`functrain.models.delta_rule_pallas`). A kernel without an estimate (cuDNN's attention, splash
attention's in this JAX) reads its operands and writes its result once; its FLOPs are the planner's, from the model's
shape (:func:`functrain.plan.planner.attention_kernel_flops`), so an estimate on an attention kernel (a later JAX) is
left out rather than counted twice. Other custom calls (buffer allocations, index assumptions) cost nothing.
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

# The custom calls that run a kernel: a TPU kernel (Mosaic), a cuBLAS matmul, a cuDNN one.
_KERNEL = re.compile(r'custom_call_target="(tpu_custom_call|__cublas\$[^"]*|__cudnn\$[^"]*)"')
_GEMM = re.compile(r'custom_call_target="__cublas\$(?:gemm|lt\$matmul)')
_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
# The cost estimate a TPU kernel's custom call carries (Mosaic's ``custom_call_config``).
_ESTIMATE = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"\d+","bytes_accessed":"(\d+)"')
# Attention kernels, whose FLOPs the planner counts from the model's shape (by the start of their custom call's name:
# ``%splash_mha_fwd_residuals.2 = ... custom-call(...)``) or by their target (cuDNN's fused attention).
_ATTENTION_KERNELS = ("splash_",)
_ATTENTION_TARGET = '"__cudnn$fmha'
_UNKNOWN = -1.0  # XLA's count of a custom call's FLOPs and bytes


def step_cost(compiled: Any, steps_per_call: int, slices: int = 1) -> dict[str, float]:
    """FLOPs and HBM bytes (``COST_KEYS``) per chip of one step of a compiled train call of ``steps_per_call``
    steps, every loop counted (see the module), and the bytes a chip sends over DCN in a step (``dcn bytes``,
    :func:`functrain.plan.dcn.dcn_bytes`) when the call spans several ``slices``."""
    text = compiled.as_text() or ""
    program = parse_program(text)
    counted = hlo_cost(loops_unrolled(text, program))
    kernels = (program.total(lambda computation, call: kernel_cost(computation, call)[0]),
               program.total(lambda computation, call: kernel_cost(computation, call)[1]))  # fmt: skip
    cost = {key: (float(counted.get(key, 0.0)) + kernel) / steps_per_call for key, kernel in zip(COST_KEYS, kernels)}
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


def kernel_cost(computation: Computation, instruction: Instruction) -> tuple[float, float]:
    """What a custom call adds to XLA's count of it (``_UNKNOWN``) to count its (FLOPs, bytes): a kernel's by its
    estimate, else its matmul's FLOPs (:func:`gemm_flops`) and its operands' and result's bytes; an attention
    kernel's FLOPs are the planner's (see the module). (0, 0) for any other instruction."""
    line = instruction.line
    if " custom-call(" not in line:
        return 0.0, 0.0
    target = _KERNEL.search(line)
    if target is None:
        return -_UNKNOWN, -_UNKNOWN
    attention = instruction.name.startswith(_ATTENTION_KERNELS) or _ATTENTION_TARGET in line
    estimate = None if attention else _ESTIMATE.search(line)
    if estimate is not None:
        flops, moved = float(estimate.group(1)), float(estimate.group(2))
    else:
        flops = 0.0 if attention else gemm_flops(computation, instruction)
        read = sum(operand.result_bytes() for operand in map(computation.instructions.get, instruction.operands)
                   if operand is not None)  # fmt: skip
        moved = float(read + instruction.result_bytes(first_only=target.group(1).startswith("__cublas$")))
    return flops - _UNKNOWN, moved - _UNKNOWN


def gemm_flops(computation: Computation, instruction: Instruction) -> float:
    """The FLOPs of a cuBLAS matmul custom call (2 x its output's elements x the contracted size; its result's
    first array, the second is cuBLAS's workspace), 0 for any other instruction."""
    line = instruction.line
    if "__cublas$" not in line or not _GEMM.search(line) or not instruction.operands:
        return 0.0
    lhs = computation.instructions.get(instruction.operands[0])
    contracting = _CONTRACTING.search(line)
    if lhs is None or contracting is None or not lhs.result_arrays() or not instruction.result_arrays():
        return 0.0
    (_, lhs_dims), (_, output) = lhs.result_arrays()[0], instruction.result_arrays()[0]
    axes = [int(axis) for axis in json.loads(f"[{contracting.group(1)}]")]
    return 2.0 * math.prod(output) * math.prod(lhs_dims[axis] for axis in axes if axis < len(lhs_dims))
