"""Several TPU slices joined over the data-centre network (DCN): ``mesh.dcn_data`` / ``mesh.dcn_fsdp`` lay a
hybrid mesh over the slices, ``functrain plan --slices N`` compiles for them and reports the bytes each chip sends
over DCN per step (read from the compiled program's transfers), their time and whether it hides under the step's
compute; bad input is one line, exit 2."""

import importlib.util

import pytest

from functrain.plan.dcn import dcn_bytes
from tests.plan.test_plan import TINY

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="the tpu extra (libtpu) is not installed")

# The shape of libtpu's compiled multi-slice program: host transfers to the Megascale runtime, in a loop.
PROGRAM = """\
%condition (loop_peel_cond_param: (s32[], f32[4])) -> pred[] {
  %constant.1 = s32[]{:T(128)} constant(3)
  ROOT %lt = pred[]{:T(512)} compare(%gte, %constant.1), direction=LT
}

%body (param: (s32[], f32[4])) -> (s32[], f32[4]) {
  %send.1 = (bf16[2,8]{1,0:T(8,128)}, u32[], token[]) send(%x, %after-all.1), channel_id=2, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_target="{1,2,3,4}x{0:7}",_xla_megascale_transfer_type="ALL_GATHER"}
  %recv.1 = (bf16[8,8]{1,0:T(8,128)}, u32[], token[]) recv(%after-all.1), channel_id=3, is_host_transfer=true, frontend_attributes={_xla_megascale_target="{1,2,3,4}x{0:7}",_xla_megascale_transfer_type="ALL_GATHER"}
}

ENTRY %main (p: f32[4]) -> f32[4] {
  %send = (f32[1,100]{1,0:T(8,128)}, u32[], token[]) send(%grad, %after-all), channel_id=1, is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:7}",_xla_megascale_transfer_type="ALL_REDUCE"}
  %while = (s32[], f32[4]) while(%tuple), condition=%condition, body=%body
  %all-reduce = f32[1,100]{1,0} all-reduce(%grad), replica_groups={{0,1,2,3}}, to_apply=%add
}
"""


def test_dcn_bytes_count_each_transfer_by_its_ring_and_its_loop():
    all_reduce = 400 * 2 * (2 - 1) / 2  # f32[1,100] over 2 slices: 2 (k-1)/k of the buffer
    all_gather = 32 * (4 - 1) * (3 - 1)  # bf16[2,8] to 3 other slices, in a loop of 3 with its first peeled off
    assert dcn_bytes(PROGRAM, slices=4) == all_reduce + all_gather
    assert dcn_bytes(PROGRAM.replace("_xla_megascale", "_xla_other"), slices=4) == 0  # in-slice collectives


def test_bad_multislice_requests_are_one_line_exit_2(capsys):
    from functrain.commands.cli import main

    cases = [
        (["--slices", "2"], "--slices 2 compiles for several slices of a TPU topology; add --topology"),
        (["mesh.dcn_pipeline=2"], "mesh.dcn_pipeline"),
    ]
    if importlib.util.find_spec("libtpu") is not None:
        cases.append((["--topology", "v5p:2x2x2", "--slices", "2", "mesh.dcn_fsdp=4"],
                      "mesh.dcn_data=1 x mesh.dcn_fsdp=4 spans 4 slice(s) but the 16 devices are 2 slice(s)"))
    for args, words in cases:
        assert main(["plan", "configs/char_gpt.yaml", *TINY, *args]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines


@needs_libtpu
def test_two_slices_compile_with_the_dcn_bytes_of_their_transfers(compilation_cache):
    from functrain.commands.plan import format_plan
    from functrain.config.load import load_config
    from functrain.plan.planner import plan

    config = load_config("configs/char_gpt.yaml", TINY + ["mesh.dcn_data=2", "mesh.data=1", "mesh.fsdp=8",
                                                          "data.global_batch_size=16"])
    planned = plan(config, "v5p:2x2x2", slices=2, dcn_gbps=25.0)
    assert planned.chips == 16 and planned.slices == 2 and planned.mesh == {"pipeline": 1, "data": 2, "fsdp": 8, "expert": 1, "context": 1, "tensor": 1}
    # The gradients cross the slices once a step: at least the parameters' float32 bytes over the FSDP shards.
    assert planned.dcn_bytes_per_step >= planned.parameters * 4 / 8
    assert planned.dcn_time_s == pytest.approx(planned.dcn_bytes_per_step * 8 / 25e9)
    assert planned.dcn_hidden == (planned.dcn_time_s <= planned.step_time_s)
    assert "DCN (2 slices):" in format_plan(planned)
