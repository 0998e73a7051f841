"""functrain plan: the run's own train call compiled ahead of time on abstract arrays, for the local devices or a
TPU topology; its figures agree with the real run's compile and with arithmetic; bad input is one line."""

import functools
import importlib.util
import json
import subprocess
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from functrain.commands.cli import main
from functrain.config.load import load_config
from functrain.plan.counting import step_cost
from functrain.plan.planner import per_chip_bytes, plan
from functrain.run.build import build_run
from tests.conftest import run_python

TINY = ["data.name=synthetic", "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "data.seq_len=16",
        "data.global_batch_size=8", "train.steps_per_call=2", "eval.samples.count=0"]
THREE_LAYERS = TINY + ["model.n_layers=3"]
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="the tpu extra (libtpu) is not installed")


def test_plan_on_local_devices_reports_the_memory_the_real_run_compiles(tmp_path, compilation_cache):
    config = load_config("configs/char_gpt.yaml", THREE_LAYERS + [f"run.dir={tmp_path / 'r'}"])
    planned = plan(config)
    run = build_run(config)
    backend = run.backend
    host = run.loader.host_batch(0)[0]
    batches = {name: np.stack([value] * config.train.steps_per_call) for name, value in host.items()}
    real = backend.compile_train_call(backend.init_state(), batches)
    assert planned.per_chip_bytes == per_chip_bytes(backend, real.memory_analysis())
    counted = step_cost(real, config.train.steps_per_call)
    assert (planned.flops_per_step, planned.bytes_per_step) == (counted["flops"], counted["bytes accessed"])
    # XLA's own count holds one step of the call's loop over its 2 steps (and XLA:CPU's scatter loops once).
    cost = real.cost_analysis()
    assert planned.flops_per_step == pytest.approx((cost[0] if isinstance(cost, list) else cost)["flops"], rel=1e-3)
    assert planned.parameters == sum(int(np.prod(leaf.shape)) for leaf in
                                     jax.tree.leaves(jax.eval_shape(run.parts.model.init, jax.random.PRNGKey(0),
                                                                    host["tokens"][:, :-1])))


def test_a_scanned_run_plans_the_flops_and_bytes_of_the_same_run_unrolled(monkeypatch, compilation_cache):
    # XLA counts the layer loop once: plan counts the scanned program with each of its 3 layers counted, so its
    # FLOPs must match the whole run unrolled.
    from functrain.commands.plan import format_plan
    from functrain.parallel.chips import Chip
    from functrain.plan import planner as plan_module
    chip = Chip("test", 2 ** 30, 1e12, 1e11)
    monkeypatch.setattr(plan_module, "chip_of", lambda kind: chip)  # a roofline on CPU devices
    scanned = plan(load_config("configs/char_gpt.yaml", THREE_LAYERS + ["model.scan_layers=true"]))
    unrolled = plan(load_config("configs/char_gpt.yaml", THREE_LAYERS))  # compiled by the test above: cached
    assert scanned.layers_scanned and not unrolled.layers_scanned
    assert abs(scanned.flops_per_step / unrolled.flops_per_step - 1) < 0.01
    # Its bytes are the scanned program's: the unrolled run's and the loop's own traffic (each layer's weights sliced
    # from their stack, its residuals stacked for the backward pass; 41% more at this tiny width), never fewer.
    assert unrolled.bytes_per_step <= scanned.bytes_per_step < 1.5 * unrolled.bytes_per_step
    roofline = max(scanned.flops_per_step / chip.peak_flops, scanned.bytes_per_step / chip.hbm_bandwidth)
    assert scanned.step_time_s == pytest.approx(roofline, rel=0.01) and 0 < scanned.mfu < 1
    assert "roofline step time" in format_plan(scanned)


LOOPED = THREE_LAYERS + ["model.scan_layers=true", "train.logits_chunk=4", "train.micro_batches=2"]
HOST_HELPERS = {"jit(_threefry_seed)", "jit(stage)"}


def test_a_plan_compiles_the_train_call_once_and_counts_every_loop_of_it(compilation_cache):
    # Counting compiles nothing of its own: the call's 2 steps, its 2 micro-batches, the 3 scanned layers and the
    # cross-entropy's 4 chunks are loops of the one program compiled for memory, each counted once per iteration
    # from its HLO. XLA:CPU annotates its loops' trip counts: those read from the loops' counters agree.
    from functrain.plan.hlo_loops import parse_program
    from functrain.plan.planned import plan_run
    from functrain.plan.planner import _compile

    compiles = []

    def compiled(event, duration, fun_name=None, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(compiled)
    try:
        planned = plan(load_config("configs/char_gpt.yaml", LOOPED))
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
    # Besides it, only the host's eager helpers of the program's assembly (a PRNG key made for its eval_shape).
    assert [name for name in compiles if name not in HOST_HELPERS] == ["jit(train_call)"]
    assert planned.flops_per_step > 0
    program = parse_program(_compile(plan_run(load_config("configs/char_gpt.yaml", LOOPED))).as_text())
    loops = program.loops()
    annotated = [program.trip_count(parent, loop) for parent, loop in loops]
    assert [program.induction_trip_count(parent, loop) for parent, loop in loops] == annotated
    assert {2, 3, 4} <= set(annotated)


def test_the_loops_counted_match_xla_s_count_of_the_run_with_every_loop_unrolled(monkeypatch, compilation_cache):
    # What the plan counted before on compiled copies with their loops unrolled: the same run traced with its layers
    # unrolled and every lax.scan (steps, micro-batches, chunks) unrolled, which XLA's own analysis counts whole.
    from functrain.plan.planned import plan_run
    from functrain.plan.planner import _compile

    planned = plan(load_config("configs/char_gpt.yaml", LOOPED))
    monkeypatch.setattr(jax.lax, "scan", functools.partial(jax.lax.scan, unroll=True))
    unrolled = _compile(plan_run(load_config("configs/char_gpt.yaml", LOOPED + ["model.scan_layers=false"])))
    cost = unrolled.cost_analysis()
    flops = (cost[0] if isinstance(cost, list) else cost)["flops"] / planned.steps_per_call
    assert abs(planned.flops_per_step / flops - 1) < 0.01


# The two plans of 4 simulated devices, in one interpreter (XLA_FLAGS set before jax): a pipelined run's schedule
# against the same run unpipelined, and the state bytes of an FSDP run.
FOUR_DEVICES = """
import json
from functrain.config.load import load_config
from functrain.plan.hlo_loops import parse_program
from functrain.plan.planned import plan_run
from functrain.plan.planner import _compile, plan
tiny = ["data.name=synthetic", "model.n_layers=4", "model.d_model=32", "model.d_ff=64", "data.seq_len=16",
        "data.global_batch_size=16", "eval.samples.count=0", "model.scan_layers=true", "model.remat=full",
        "train.micro_batches=2", "mesh.data=2"]
pipelined = load_config("configs/char_gpt.yaml", tiny + ["mesh.pipeline=2"])
program = parse_program(_compile(plan_run(pipelined)).as_text())
loops = program.loops()
fsdp = load_config("configs/char_gpt.yaml", ["data.name=synthetic", "mesh.fsdp=4", "mesh.data=1", "model.d_model=128",
                                             "model.n_layers=2", "data.seq_len=32"])
print("RESULT", json.dumps({
    "annotated": [program.trip_count(parent, loop) for parent, loop in loops],
    "read": [program.induction_trip_count(parent, loop) for parent, loop in loops],
    "pipelined": plan(pipelined).to_json(),
    "unpipelined": plan(load_config("configs/char_gpt.yaml", tiny + ["mesh.data=4"])).to_json(),
    "fsdp": plan(fsdp).to_json()}))
"""


def _result(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))[7:])


@pytest.fixture(scope="module")
def four_devices() -> dict:
    return _result(run_python(FOUR_DEVICES, devices=4))


def test_a_pipelined_plan_counts_every_iteration_of_its_schedule(four_devices):
    # 2 stages x 2 pipeline micro-batches: 3 iterations, on each of which both stages compute their 2 of the 4
    # layers, busy or idle (bubble 1/3), and the backward pass 3 more. Against the same run unpipelined on the same 4
    # chips, a pipelined chip has twice the rows and half the layers: its layers cost 1 / (1 - bubble) = 1.5 times
    # theirs (more with the forward its checkpointed iterations run again), the rest (embedding, head, loss) 2 times.
    found = four_devices
    assert found["read"] == found["annotated"] and found["annotated"].count(3) == 2
    pipelined, unpipelined = found["pipelined"], found["unpipelined"]
    assert pipelined["pipeline_bubble"] == pytest.approx(1 / 3) and pipelined["mesh"]["pipeline"] == 2
    assert 1.5 < pipelined["flops_per_step"] / unpipelined["flops_per_step"] < 2


def test_a_chunked_cross_entropy_is_planned_with_every_chunk_counted(compilation_cache):
    # XLA counts the chunk loop's body once: plan counts a new trace of the run with the loop unrolled, so the
    # chunked loss costs what the whole one does plus the head's forward recomputed in the backward pass.
    whole = plan(load_config("configs/char_gpt.yaml", TINY))
    chunked = plan(load_config("configs/char_gpt.yaml", TINY + ["train.logits_chunk=4"]))
    recompute = 2 * 32 * 256 * 8 * 15 / whole.chips  # 2 x d_model x vocab x tokens, per chip
    assert 0.9 * recompute < chunked.flops_per_step - whole.flops_per_step < 1.5 * recompute


def test_state_bytes_per_chip_are_parameters_times_bytes_over_fsdp_shards(four_devices):
    # AdamW in float32: 4 bytes of weight and 8 of moments per parameter, split over 4 FSDP shards.
    report = four_devices["fsdp"]
    state = report["per_chip_bytes"]["params"] + report["per_chip_bytes"]["optimizer"]
    assert report["chips"] == 4 and report["mesh"]["fsdp"] == 4
    assert abs(state / (12 * report["parameters"] / 4) - 1) < 0.10


BAD_PLANS = [
    (["--topology", "v9z:2x2"], ["unknown TPU topology 'v9z:2x2'", "v5p:4x4x8"]),
    (["--topology", "v5e:2x2", "mesh.fsdp=3"], ["mesh.fsdp=3", "4 devices"]),
    (["--topology", "v5e:2x2", "data.global_batch_size=6"], ["data.global_batch_size", "6"]),
]
# Every plan through libtpu in one interpreter (each process loads libtpu anew: seconds of CPU). First, as its start,
# `functrain plan` for a v5e topology run as the command line runs it (python -m functrain: libtpu's start-up lines
# would show on its stderr); then the plans of a small Llama on v5p; then the bad plans, each through the CLI's entry
# point. Each part's stdout and stderr end at a line "@@" of their own.
TPU_PLANS = """
import json, runpy, sys
sys.argv = ["functrain", "plan", "configs/char_gpt.yaml", *TINY, "--topology", "v5e:2x2", "--json"]
try:
    runpy.run_module("functrain", run_name="__main__")
except SystemExit as exit:
    codes = [exit.code]


def part_ends():
    print("@@", flush=True)
    print("@@", file=sys.stderr, flush=True)


part_ends()
from functrain.commands.cli import main
from functrain.config.load import load_config
from functrain.report.mfu import train_flops_per_token
from functrain.plan.planner import plan
small = ["model.vocab_size=1024", "model.hidden_size=256", "model.intermediate_size=512",
         "model.num_attention_heads=4", "model.num_key_value_heads=4",
         "data.seq_len=1024", "data.global_batch_size=8", "train.micro_batches=1", "model.remat=full"]
plans = []
# One layer each (one compile a plan); counting a scan's groups and the other loops is checked on CPU (above).
for scan, attention, layers in (("true", "auto", 1), ("false", "xla", 1)):
    config = load_config("configs/llama3_8b.yaml", small + [f"model.scan_layers={scan}",
                         f"model.attention={attention}", f"model.num_hidden_layers={layers}"])
    planned = plan(config, "v5p:2x2x2")
    shape = config.model.decoder_shape()
    per_token = train_flops_per_token(shape, 1024)
    # remat: full runs each block's forward again (a third of its training FLOPs; the head is in none),
    # but for the block's last matmul, whose output the backward pass does not need.
    down_proj = 2 * shape.width * shape.mlp_width * shape.layers
    recomputed = (per_token - 6 * shape.width * shape.vocab) / 3 - down_proj
    plans.append({"flops": planned.flops_per_step * planned.chips, "mfu": planned.mfu,
                  "attention": planned.attention, "scanned": planned.layers_scanned,
                  "floor": (per_token + recomputed) * 8 * 1024})
print(json.dumps(plans))
part_ends()
for args in BAD_PLANS:
    codes.append(main(["plan", "configs/char_gpt.yaml", *TINY, *args]))
    part_ends()
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def tpu_plans() -> dict:
    code = f"TINY = {TINY!r}\nBAD_PLANS = {[args for args, _ in BAD_PLANS]!r}\n{TPU_PLANS}"
    proc = run_python(code, timeout=900)
    v5e_out, plans, *bad_out, codes = proc.stdout.split("@@\n")
    v5e_err, _, *bad_err, after = proc.stderr.split("@@\n")
    v5e_code, *bad_codes = json.loads(codes)
    return {"v5e": (v5e_code, v5e_out, v5e_err, after), "plans": json.loads(plans),
            "bad": list(zip(bad_codes, bad_err))}


@needs_libtpu
def test_planned_flops_hold_the_model_flops_and_the_recompute_so_mfu_stays_below_one(tpu_plans):
    # libtpu splits a matmul fed by an FSDP all-gather into a loop over the shards (a windowed einsum) whose body
    # cost_analysis counted once: Llama 3 8B on v5p:2x2x2 was planned at half its FLOPs and an MFU of 113%. This
    # small Llama's 8 x 1024 tokens are enough for libtpu to split its matmuls so (into 16 loops of 2; at 8 x 512
    # tokens it splits none, whatever the width). Scanned with splash, and unrolled with XLA's attention.
    plans = tpu_plans["plans"]
    assert [(p["scanned"], p["attention"]) for p in plans] == [(True, "splash"), (False, "xla")]
    for planned in plans:
        assert planned["flops"] >= planned["floor"], planned
        assert 0 < planned["mfu"] <= 1, planned


def test_a_small_config_compiles_for_a_v5e_topology_and_fits(tpu_plans):
    returncode, stdout, stderr, at_exit = tpu_plans["v5e"]
    assert returncode == 0, stderr
    # libtpu told what this host is: none of its start-up warnings (nor any at the interpreter's exit)
    assert stderr == "" and at_exit == ""
    report = json.loads(stdout)
    assert report["device_kind"] == "TPU v5e" and report["chips"] == 4  # as the topology names it ("TPU v5 lite")
    assert report["attention"] == "splash"  # model.attention=auto, decided for the TPU, not this CPU process
    assert report["hbm_bytes"] == 16 * 2 ** 30 and report["fits"] is True
    assert 0 < report["mfu"] < 1 and report["step_time_s"] > 0
    for key in ("parameters", "seq_len", "flops_per_step", "bytes_per_step"):
        assert report[key] > 0
    assert set(report["per_chip_bytes"]) >= {"params", "optimizer", "activations", "total"}


def test_plan_prints_a_readable_table_for_local_devices(capsys):
    # Through the CLI's entry point in this process: the same TINY plan as the chunked cross-entropy test's.
    assert main(["plan", "configs/char_gpt.yaml", *TINY]) == 0
    stdout = capsys.readouterr().out
    assert "per chip:" in stdout and "activations" in stdout and "fits: unknown" in stdout
    assert "; xla attention" in stdout.splitlines()[0]


@needs_libtpu
@pytest.mark.parametrize("case", range(len(BAD_PLANS)))
def test_bad_plans_are_one_line_exit_2(case, tpu_plans):
    returncode, stderr = tpu_plans["bad"][case]
    errors = [line for line in stderr.splitlines() if line.startswith("functrain: error:")]
    assert returncode == 2 and len(errors) == 1, stderr
    for word in BAD_PLANS[case][1]:
        assert word in errors[0]


def _fake_plans(monkeypatch, reported_per_sample):
    """``plan`` as a search sees it: a chip that holds 64 samples with remat=dots_saveable (8 units of state, one a
    sample; none takes 8 a sample, full half of one), whose reported memory grows by ``reported_per_sample`` a
    sample (the search predicts from it)."""
    from functrain.commands import plan_search
    from functrain.plan.planner import HBM_USABLE

    def fake_plan(config, topology, slices=None, devices=None):
        batch, remat = config.data.global_batch_size, config.model.remat
        need = 8 + batch * {"none": 8, "dots_saveable": 1, "full": 0.5}[remat]
        reported = 8 + batch * (reported_per_sample if remat == "dots_saveable" else 8)
        sizes = {"params": 4, "optimizer": 4, "model_state": 0, "total": reported}
        return SimpleNamespace(fits=need <= 72, mesh={"data": 2, "fsdp": 2, "tensor": 1}, per_chip_bytes=sizes,
                               hbm_bytes=72 / HBM_USABLE)

    monkeypatch.setattr(plan_search, "plan", fake_plan)
    config = load_config("configs/gpt_350m.yaml", ["data.name=synthetic", "data.global_batch_size=16"])
    return plan_search.search(config)


def test_search_takes_the_cheapest_remat_that_fits_then_the_largest_batch_the_memory_predicts(monkeypatch):
    tried, chosen = _fake_plans(monkeypatch, reported_per_sample=1)
    # 16 samples fill 24 of 72 units, 16 of them growing with the batch: 64 fits (predicted), 128 does not (checked).
    assert [(c.remat, c.global_batch_size) for c in tried] == [
        ("none", 16), ("dots_saveable", 16), ("dots_saveable", 64), ("dots_saveable", 128)]
    assert (chosen.remat, chosen.global_batch_size, chosen.per_chip_batch) == ("dots_saveable", 64, 16)


@pytest.mark.parametrize("reported_per_sample", [0.5, 2])
def test_a_search_whose_prediction_is_off_steps_to_the_largest_batch_that_fits(monkeypatch, reported_per_sample):
    tried, chosen = _fake_plans(monkeypatch, reported_per_sample)
    # Memory reported at half its growth predicts 128 (it does not fit: one doubling down); at twice, 32 (up).
    expected = [128, 64] if reported_per_sample < 1 else [32, 64, 128]
    assert [c.global_batch_size for c in tried[2:]] == expected
    assert (chosen.remat, chosen.global_batch_size) == ("dots_saveable", 64)


def test_a_program_the_tpu_compiler_refuses_is_reported_as_not_fitting():
    from functrain.plan.planner import _required_temporaries
    message = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
               "(114.76G) exceeds available HBM (95.74G).")
    assert _required_temporaries(message) == int(114.76 * 2 ** 30)
    assert _required_temporaries("INTERNAL: something else") is None


def test_a_mesh_the_torus_cannot_hold_is_one_line(monkeypatch):
    from functrain.errors import ConfigError
    from functrain.parallel import sharding

    def refuse(*args, **kwargs):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 1 of size 256 with remaining "
                                  "assignable mesh [8, 8, 8].\nmore")

    monkeypatch.setattr(sharding.jax, "make_mesh", refuse)
    config = load_config("configs/char_gpt.yaml", ["mesh.data=1"])
    with pytest.raises(ConfigError, match=r"mesh.data=1 mesh.fsdp=1 mesh.expert=1 mesh.context=1 mesh.tensor=1 cannot be laid .*size 256"):
        sharding.make_mesh(config.mesh)
