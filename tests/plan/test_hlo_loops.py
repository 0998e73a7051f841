"""A compiled program's loops read from its HLO text: each loop's trip count (XLA's annotation, else its induction
variable: start, step and bound, whatever its form), the program with its loops unrolled into calls counted whole by
XLA's cost analysis, and the FLOPs of a cuBLAS matmul and of a TPU kernel, which that analysis does not see."""

from types import SimpleNamespace

import pytest

from functrain.plan.counting import hlo_cost, step_cost
from functrain.plan.hlo_loops import loops_unrolled, parse_program

TUPLE = "(s32[], f32[8,16]{1,0}, f32[16,4]{1,0}, f32[8,4]{1,0})"
# x @ w accumulated in a loop whose counter starts at START, steps by STEP and runs while COMPARE holds.
PROGRAM = f"""\
HloModule loops

%body (param: {TUPLE}) -> {TUPLE} {{
  %param = {TUPLE} parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %x = f32[8,16]{{1,0}} get-tuple-element(%param), index=1
  %w = f32[16,4]{{1,0}} get-tuple-element(%param), index=2
  %acc = f32[8,4]{{1,0}} get-tuple-element(%param), index=3
  PRODUCT
  %sum = f32[8,4]{{1,0}} add(%acc, %dot)
  %step = s32[] constant(STEP)
  %next = s32[] add(%i, %step)
  ROOT %out = {TUPLE} tuple(%next, %x, %w, %sum)
}}

%condition (param.1: {TUPLE}) -> pred[] {{
  %param.1 = {TUPLE} parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %bound = s32[] constant(BOUND)
  ROOT %holds = pred[] COMPARE
}}

ENTRY %main (x.1: f32[8,16], w.1: f32[16,4]) -> f32[8,4] {{
  %x.1 = f32[8,16]{{1,0}} parameter(0)
  %w.1 = f32[16,4]{{1,0}} parameter(1)
  %zero = f32[] constant(0)
  %acc.1 = f32[8,4]{{1,0}} broadcast(%zero), dimensions={{}}
  %start = s32[] constant(START)
  %start.copy = s32[] copy(%start)
  %init = {TUPLE} tuple(%start.copy, %x.1, %w.1, %acc.1)
  %loop = {TUPLE} while(%init), condition=%condition, body=%body
  ROOT %result = f32[8,4]{{1,0}} get-tuple-element(%loop), index=3
}}
"""
DOT = "%dot = f32[8,4]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}"
# A GPU program's matmul: a cuBLAS call (its result and a workspace), whose FLOPs XLA's analysis does not count.
GEMM = (
    '%gemm = (f32[8,4]{1,0}, s8[0]{0}) custom-call(%x, %w), custom_call_target="__cublas$gemm", '
    'backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":'
    '{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
    '"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}\n'
    "  %dot = f32[8,4]{1,0} get-tuple-element(%gemm), index=0"
)
MATMUL_FLOPS = 2 * 8 * 4 * 16
MATMUL_BYTES = 4 * (8 * 16 + 16 * 4 + 8 * 4)  # x and w read, the product written
# A TPU kernel (libtpu's grouped matmul for ragged_dot, a Pallas kernel) with the cost estimate Mosaic carries.
KERNEL = (
    '%NAME = f32[8,4]{1,0} custom-call(%x, %w), custom_call_target="tpu_custom_call", backend_config='
    '{"custom_call_config":{"body":"TUxJUgo=","cost_estimate":{"flops":"' + str(MATMUL_FLOPS) + '",'
    '"transcendentals":"0","bytes_accessed":"' + str(MATMUL_BYTES) + '"}}}\n'
    "  %dot = f32[8,4]{1,0} bitcast(%NAME)"
)


def program(start=0, step=1, bound=3, compare="compare(%i.1, %bound), direction=LT", product=DOT):
    return (PROGRAM.replace("START", str(start)).replace("STEP", str(step)).replace("BOUND", str(bound))
            .replace("COMPARE", compare).replace("PRODUCT", product))


def trips(text):
    parsed = parse_program(text)
    return [parsed.trip_count(parent, loop) for parent, loop in parsed.loops()]


@pytest.mark.parametrize("start, step, bound, compare, count", [
    (0, 1, 3, "compare(%i.1, %bound), direction=LT", 3),  # a JAX scan
    (0, 2, 4, "compare(%i.1, %bound), direction=LT", 2),  # libtpu's collective matmul: two shards a turn
    (1, 2, 7, "compare(%i.1, %bound), direction=LT", 3),  # 1, 3, 5
    (1, 2, 7, "compare(%bound, %i.1), direction=GT", 3),  # the bound on the left
    (0, 3, 9, "compare(%i.1, %bound), direction=LE", 4),  # 0, 3, 6, 9
    (5, 1, 3, "compare(%i.1, %bound), direction=LT", 0),  # never runs
])
def test_a_loop_runs_as_often_as_its_counter_allows(start, step, bound, compare, count):
    assert trips(program(start, step, bound, compare)) == [count]


def test_xla_s_own_trip_count_wins_and_an_unknown_start_falls_back_on_the_bound():
    annotated = program().replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}')
    assert trips(annotated) == [5]
    computed = program(bound=6).replace("%start.copy = s32[] copy(%start)", "%start.copy = s32[] add(%start, %start)")
    assert trips(computed) == [6]  # the start is not a constant: the bound alone


def test_a_program_with_its_loops_unrolled_is_counted_once_per_iteration():
    once, thrice = (hlo_cost(loops_unrolled(program(bound=bound))) for bound in (1, 3))
    assert once["flops"] == MATMUL_FLOPS + 8 * 4 + 1  # the matmul, the accumulation, the counter
    assert thrice["flops"] == 3 * once["flops"] and thrice["bytes accessed"] > 2.5 * once["bytes accessed"]
    assert hlo_cost(program(bound=3))["flops"] < 1.1 * once["flops"]  # XLA's own count: the body once
    rooted = (program(bound=3).replace("%loop = ", "ROOT %loop = ").replace("  ROOT %result", "  %result")
              .replace("f32[16,4]) -> f32[8,4] {", f"f32[16,4]) -> {TUPLE} {{"))
    assert hlo_cost(loops_unrolled(rooted))["flops"] == thrice["flops"]  # a loop that is its computation's root


def counted(text: str, steps_per_call: int = 1) -> dict:
    return step_cost(SimpleNamespace(as_text=lambda: text), steps_per_call=steps_per_call)


def test_a_cublas_matmul_in_a_loop_is_counted_each_iteration_as_xla_counts_a_dot():
    # XLA's analysis counts a custom call as unknown (-1 FLOPs, -1 bytes)
    text, dotted = program(bound=3, product=GEMM), hlo_cost(loops_unrolled(program(bound=3)))
    assert hlo_cost(loops_unrolled(text))["flops"] < MATMUL_FLOPS
    assert counted(text) == {"flops": dotted["flops"], "bytes accessed": dotted["bytes accessed"]}  # as a dot
    assert counted(text)["flops"] == 3 * (MATMUL_FLOPS + 8 * 4 + 1)  # the matmul, accumulation, counter
    assert counted(text, steps_per_call=3)["flops"] == counted(text)["flops"] / 3


def test_a_tpu_kernel_in_a_loop_counts_its_estimate_each_iteration_but_attention_s_flops_are_the_planner_s():
    # libtpu's ragged_dot kernel (a mixture of experts' expert matmuls) was left out: Qwen3-30B-A3B planned 2.9% low
    dotted = hlo_cost(loops_unrolled(program(bound=3)))
    kernel = counted(program(bound=3, product=KERNEL.replace("NAME", "ragged-dot-none.3")))
    assert kernel == {"flops": dotted["flops"], "bytes accessed": dotted["bytes accessed"]}
    # splash's kernels carry no estimate: their operands and result are the bytes, their FLOPs the planner's
    splash = counted(program(bound=3, product=KERNEL.replace("NAME", "splash_mha_fwd_residuals.2")))
    assert splash == {"flops": dotted["flops"] - 3 * MATMUL_FLOPS, "bytes accessed": dotted["bytes accessed"]}
    unestimated = KERNEL.replace("NAME", "ragged-dot-none.3").replace('"cost_estimate"', '"no_estimate"')
    assert counted(program(bound=3, product=unestimated)) == splash  # nor does any other kernel without one
