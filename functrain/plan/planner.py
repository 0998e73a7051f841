"""Plan a run before renting the hardware: compile its train call ahead of time and read what XLA says.

:func:`plan` builds the run exactly as ``functrain train`` would (the same builder, sharding rules and step; see
:func:`functrain.plan.planned.plan_run`) on abstract arrays (``jax.ShapeDtypeStruct`` with shardings: nothing the
size of the model is allocated), compiles the train call for the local devices or for a TPU topology through
libtpu, and reports per chip: state bytes by part, XLA's temporaries (activations), the total against the chip's
HBM, FLOPs and HBM bytes of a step (``cost_analysis``), a roofline step time and the MFU it implies.

XLA's ``cost_analysis`` counts a loop body once: the call's scan over ``train.steps_per_call`` steps therefore
counts one step, and the scan over ``train.micro_batches`` one micro-batch, so FLOPs and bytes are multiplied by
``micro_batches`` (the optimizer update, outside that loop, is then over-counted: under 1% for LMs).

libtpu turns an FSDP all-gather (or a reduce-scatter) that feeds a matmul into a loop over the shards, each turn
multiplying one shard while the next arrives (a windowed einsum, "collective matmul"), and counts that loop's body
once too: the llama3_8b plan counted half its FLOPs and reported an MFU of 113%. FLOPs and bytes are therefore
counted on the same run compiled with those loops off (:data:`COUNTED_WHOLE`); memory is the real program's.

With ``model.scan_layers`` the layers are a loop too, over ``G`` groups of ``period`` layers: the scanned
program's count holds one group's forward and backward pass but the optimizer update of all ``G`` groups'
stacked parameters (outside the loop), so no multiple of it is right. The step's FLOPs and bytes are measured
instead on the same run (mesh, shardings, batch, remat, attention) compiled unrolled with one group and with two
(each with the remainder layers after the last whole group): ``cost(1) + (G - 1) * (cost(2) - cost(1))``, which
is, layer for layer, the cost of the whole run unrolled (:func:`scanned_run_cost`). Memory is the scanned
program's own.

A causal LM's cross-entropy over chunks of positions (``train.logits_chunk``) is a loop too: a run that traced one
is counted on a new trace of it with the chunks unrolled (:func:`functrain.core.unembedding.counted_whole`). Unrolled,
the chunks' logits no longer take turns in HBM: a counting compile the TPU compiler refuses for HBM is compiled
again on micro-batches split 2, 4, ... ways and its cost scaled back (:func:`counted_copy`).

Pipelined (``mesh.pipeline`` stages, :mod:`functrain.parallel.pipeline`), each chip computes its stage's share
of the layers on every iteration of the schedule, busy or idle: the unrolled copies run with the stages folded
into the data axis, and their layers' cost is divided by ``1 - bubble`` (:func:`pipelined_run_cost`); the bubble
is reported.

Over several TPU slices (``--slices``), the bytes each chip sends over the data-centre network per step are read
from the counted program's transfers (:mod:`functrain.plan.dcn`), with their time at a DCN bandwidth.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from functrain.config.schema import Config
from functrain.core.unembedding import chunk_loops_traced, counted_whole
from functrain.errors import ConfigError
from functrain.models.configs.moe import MoeOptions
from functrain.parallel.chips import chip_of
from functrain.parallel.pipeline import PIPELINE_AXIS, bubble_fraction, microbatch_count
from functrain.parallel.platform import describe_host_to_libtpu
from functrain.parallel.sharding import state_bytes_per_device
from functrain.plan.dcn import dcn_bytes
from functrain.plan.planned import Planned, plan_run
from functrain.report.mfu import train_flops_per_token

TOPOLOGY_EXAMPLES = ("v4:2x2x2", "v5e:4x4", "v5p:4x4x8", "v6e:16x16")
# Part of HBM a plan may fill: the runtime, the compiled program and fragmentation take the rest.
HBM_USABLE = 0.95
# DCN bandwidth per chip, Gbit/s: Cloud TPU v5p's data sheet ("Data center network (DCN) bandwidth per chip").
DEFAULT_DCN_GBPS = 50.0


def topology_devices(name: str, slices: int = 1) -> list:
    """The devices of ``slices`` slices of TPU topology ``name`` (``v5p:2x2x2``), described by libtpu (each with
    its ``slice_index``); no TPU needs to be attached."""
    if importlib.util.find_spec("libtpu") is None:
        raise ConfigError(
            f"--topology {name} compiles through libtpu, which is not installed; pip install 'functrain[tpu]'"
        )
    # Planning only compiles: it may share libtpu with a training process that holds libtpu's lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    describe_host_to_libtpu(name)
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, num_slices=slices).devices)
    except Exception as exc:  # noqa: BLE001 -- libtpu: XlaRuntimeError/JaxRuntimeError/ValueError
        raise ConfigError(
            f"unknown TPU topology {name!r} ({str(exc).splitlines()[0][:120]}); give GENERATION:SHAPE, "
            f"one of the generations v4, v5e, v5p, v6e, e.g. {', '.join(TOPOLOGY_EXAMPLES)}"
        ) from None


@dataclass(frozen=True)
class Plan:
    """What one compile of a run's train call says, per chip (bytes, FLOPs) unless named otherwise."""

    device_kind: str
    chips: int
    mesh: dict[str, int]
    parameters: int
    seq_len: int
    global_batch_size: int
    micro_batches: int
    steps_per_call: int
    per_chip_bytes: dict[str, int]  # params, optimizer, model_state, batch, activations, total
    hbm_bytes: int | None
    flops_per_step: float  # per chip, as compiled
    bytes_per_step: float  # HBM bytes accessed per chip
    model_flops_per_step: float | None  # analytic, all chips (causal attention halved, as MaxText)
    step_time_s: float | None  # roofline: max(FLOPs / peak, bytes / bandwidth)
    mfu: float | None
    tokens_per_sec_per_chip: float | None
    fits: bool | None
    compiled: bool = True  # False: the compiler refused it (too large); FLOPs unknown (0)
    layers_scanned: bool = False  # model.scan_layers: FLOPs and bytes measured unrolled (module)
    advice: list[str] = field(default_factory=list)
    attention: str | None = None  # the attention kernel compiled: splash, cudnn, xla (None: no LM)
    experts: str | None = None  # a mixture of experts' matmuls as compiled (expert_kernel_of; None: no experts)
    slices: int = 1  # TPU slices joined over the data-centre network (DCN)
    dcn_bytes_per_step: float | None = None  # per chip, sent over DCN (functrain.plan.dcn); None: one slice
    dcn_gbps: float | None = None  # the DCN bandwidth per chip the time is computed at
    dcn_time_s: float | None = None  # dcn_bytes_per_step at dcn_gbps
    dcn_hidden: bool | None = None  # the DCN time fits under the roofline step time (overlapped with compute)
    pipeline_repeats: int = 1  # pipeline.repeats: the chunks of layers each stage holds
    pipeline_microbatches: int | None = None  # the pipeline's micro-batches per batch (None: no pipeline)
    pipeline_bubble: float | None = None  # the share of each stage's iterations spent idle (None: no pipeline)

    def to_json(self) -> dict[str, Any]:
        """The plan as one JSON-able object (``functrain plan --json``)."""
        return asdict(self)


def _first(cost: Any) -> dict:
    return (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}


class _RefusedMemory:
    """``memory_analysis()``'s fields for a program the compiler refused: the arguments (state and batches, from
    their shardings), the state as output, donated, and the temporaries the refusal named."""

    def __init__(
        self, backend: Any, example_batch: dict[str, np.ndarray], steps_per_call: int, temporaries: int
    ) -> None:
        state, batches = backend.abstract_train_args(example_batch, steps_per_call)
        whole = state_bytes_per_device(state, backend.state_shardings)[0]
        batch = state_bytes_per_device(batches, jax.tree.map(lambda leaf: leaf.sharding, batches))[0]
        self.argument_size_in_bytes, self.output_size_in_bytes = whole + batch, whole
        self.alias_size_in_bytes, self.temp_size_in_bytes = whole, temporaries


def per_chip_bytes(backend: Any, memory: Any) -> dict[str, int]:
    """State bytes per chip by part (from the shardings' shard shapes), the batch, XLA's temporaries and the total
    (arguments + outputs - donated aliases + temporaries)."""
    state, shardings = backend.abstract_state, backend.state_shardings
    params = state_bytes_per_device(state.params, shardings.params)[0]
    optimizer = state_bytes_per_device(state.opt_state, shardings.opt_state)[0]
    whole = state_bytes_per_device(state, shardings)[0]
    arguments = int(memory.argument_size_in_bytes)
    total = (
        arguments + int(memory.output_size_in_bytes) - int(memory.alias_size_in_bytes) + int(memory.temp_size_in_bytes)
    )
    return {
        "params": params,
        "optimizer": optimizer,
        "model_state": whole - params - optimizer,
        "batch": max(arguments - whole, 0),
        "activations": int(memory.temp_size_in_bytes),
        "total": total,
    }


def advice(planned: Planned, sizes: dict[str, int], chips: int, mesh: dict[str, int]) -> list[str]:
    """Settings that would shrink the largest parts, most effective first."""
    step, model = planned.step, planned.model_config
    tips = []
    state = sizes["params"] + sizes["optimizer"]
    if mesh["fsdp"] < chips and state > sizes["activations"] / 2:
        tips.append(f"raise mesh.fsdp (now {mesh['fsdp']}; up to {chips}) to shard parameters and optimizer state")
    if sizes["activations"] > state / 4:
        tips.append(f"raise train.micro_batches (now {step.micro_batches}) to hold fewer activations")
        remat = model.remat_policy()
        if remat not in (None, "full"):  # a model without the option (a user's) gets no such tip
            tips.append(f"set model.remat=full (now {remat}) to recompute activations in the backward pass")
    if step.param_dtype == "float32" and not step.offload_optimizer:
        tips.append("set train.offload_optimizer=true to keep optimizer state in host memory")
    return tips


COST_KEYS = ("flops", "bytes accessed")
# The cost entry of the bytes a chip sends over DCN in one train call (counted_cost).
DCN_KEY = "dcn bytes"
# libtpu's options for a program compiled to be counted: every matmul whole, none split into a windowed einsum's
# loop (whose body cost_analysis would count once; see the module docstring).
COUNTED_WHOLE = {
    "xla_tpu_enable_windowed_einsum_for_all_gather": False,
    "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
}


def chip_name(topology: str) -> str:
    """``v5p:4x4x8`` -> ``TPU v5p``: the chip as the topology names it (libtpu's device kind is ``TPU v5`` for a
    v5p and ``TPU v5 lite`` for a v5e)."""
    return f"TPU {topology.partition(':')[0]}"


def check_slices(topology: str | None, slices: int | None, dcn_gbps: float) -> None:
    """``--slices`` needs a TPU ``--topology`` and is at least 1; ``--dcn-gbps`` is positive (one-line errors)."""
    if slices is not None and topology is None:
        raise ConfigError(
            f"--slices {slices} compiles for several slices of a TPU topology; add --topology (e.g. v5p:4x4x4)"
        )
    if slices is not None and slices < 1:
        raise ConfigError(f"--slices {slices} is not a number of slices; give 1 or more")
    if not dcn_gbps > 0:
        raise ConfigError(f"--dcn-gbps {dcn_gbps} is not a bandwidth; give Gbit/s per chip, e.g. {DEFAULT_DCN_GBPS:g}")


def plan(
    config: Config, topology: str | None = None, slices: int | None = None, dcn_gbps: float = DEFAULT_DCN_GBPS
) -> Plan:
    """Compile ``config``'s train call for the local devices or TPU ``topology`` (``slices`` of it joined over DCN,
    spanned by ``mesh.dcn_data`` x ``mesh.dcn_fsdp``) and report (see the module); ``dcn_gbps``: the DCN bandwidth
    per chip the DCN time is computed at."""
    check_slices(topology, slices, dcn_gbps)
    slices = slices or 1
    planned = plan_run(config, topology_devices(topology, slices) if topology else None)
    device_kind = chip_name(topology) if topology else None
    try:
        with chunk_loops_traced() as chunk_loops:
            compiled = _compile(planned.backend, planned)
    except jax.errors.JaxRuntimeError as exc:
        required = _required_temporaries(str(exc))
        if required is None:
            raise
        return report(planned, None, temporaries=required, device_kind=device_kind)
    if planned.scan_groups > 1:
        schedule = pipeline_schedule_of(planned)
        cost = scanned_run_cost(planned, slices) if schedule is None else pipelined_run_cost(planned, slices, schedule)
    elif chunk_loops:  # the cross-entropy's chunk loop, counted unrolled on a new trace of the run
        assert planned.rebuilt_backend is not None, "plan_run builds every run's rebuilt_backend"
        cost, _ = counted_copy(planned, planned.rebuilt_backend, slices)
    elif _on_tpu(planned.backend):
        cost = counted_cost(_compile(planned.backend, planned, counted=True), slices)
    else:
        cost = None  # the compiled program's own count is whole
    return report(planned, compiled, cost=cost, device_kind=device_kind, slices=slices, dcn_gbps=dcn_gbps)


def counted_cost(compiled: jax.stages.Compiled, slices: int) -> dict[str, float]:
    """XLA's cost (``COST_KEYS``) of a compiled train call, with the bytes each chip sends over DCN
    (``dcn bytes``, :func:`functrain.plan.dcn.dcn_bytes`) when it spans several slices."""
    cost = dict(_first(compiled.cost_analysis()))
    if slices > 1:
        cost[DCN_KEY] = dcn_bytes(compiled.as_text() or "", slices)
    return cost


def _on_tpu(backend: Any) -> bool:
    return backend.devices[0].platform == "tpu"


def _compile(backend: Any, planned: Planned, counted: bool = False) -> jax.stages.Compiled:
    """The train call compiled; ``counted``: for cost_analysis (matmuls whole on TPU, :data:`COUNTED_WHOLE`)."""
    options = COUNTED_WHOLE if counted and _on_tpu(backend) else None
    args = backend.abstract_train_args(planned.example_batch, planned.steps_per_call)
    return backend.compile_train_call(*args, compiler_options=options)


def pipeline_schedule_of(planned: Planned) -> tuple[int, int, int] | None:
    """``(stages, repeats, micro-batches)`` of a pipelined run's schedule; None when its layers are not pipelined."""
    backend = planned.backend
    stages = int(backend.mesh.shape.get(PIPELINE_AXIS, 1))
    if stages == 1:
        return None
    rows = planned.global_batch_size // planned.step.micro_batches
    return stages, backend.pipeline.repeats, microbatch_count(backend.pipeline.microbatches, stages, rows)


def pipelined_run_cost(planned: Planned, slices: int, schedule: tuple[int, int, int]) -> dict[str, float]:
    """XLA's cost (``COST_KEYS``, per chip, one micro-batch) of a pipelined run's train call: :func:`scanned_run_cost`
    on copies whose stages are folded into the data axis (each chip has ``1 / stages`` of the rows, so the copies
    fit where the run without its pipeline would), scaled back to a pipelined chip: its rows ``stages`` times the
    copy's, its layers ``1 / stages`` of them for ``1 - bubble`` of the time (``schedule``: stages, repeats,
    micro-batches), and their work grown by the forward pass the schedule's checkpointed iterations run again
    (:func:`pipelined_layer_work`). Bytes scale with the rows too: the weights' reads are over-counted. The DCN
    bytes are the copies' (the stages' activations between slices are not counted)."""
    stages = schedule[0]
    work = pipelined_layer_work(planned.model_config.remat_policy())
    cost = scanned_run_cost(planned, slices, layer_share=work / (stages * (1 - bubble_fraction(*schedule))))
    return {key: value * stages if key in COST_KEYS else value for key, value in cost.items()}


def pipelined_layer_work(remat: str) -> float:
    """A pipelined chip's work on its layers over what the unpipelined counting copies count for them: each of the
    schedule's iterations is checkpointed (:mod:`functrain.parallel.pipeline`), so the backward pass runs the
    stage's layers forward once more. In matmul FLOPs a token and weight, the copies count a forward pass (2) and a
    backward one (4), and with ``remat: full`` the forward again (2); the pipeline adds one forward (2)."""
    counted = 8 if remat == "full" else 6
    return (counted + 2) / counted


def scanned_run_cost(planned: Planned, slices: int = 1, layer_share: float = 1.0) -> dict[str, float]:
    """XLA's cost (``COST_KEYS``, per chip, one micro-batch; and the DCN bytes of the call over ``slices`` slices)
    of a scanned run's train call with all its layers counted: the same run compiled with one group of layers and
    with two, unrolled, extrapolated to its ``scan_groups`` groups (identical groups cost the same; what lies
    outside the layers is in both). ``layer_share``: the share of the groups' cost each chip computes
    (:func:`pipelined_run_cost`).

    Unrolled, the cross-entropy's chunks no longer take turns in HBM (llama3_8b on v5p:2x2x2: 121 GiB of
    temporaries for one group of layers, 14.6 GiB with the chunk loop): a copy the TPU compiler refuses is counted
    on micro-batches split in 2, 4, ... (:func:`counted_copy`), its cost scaled back by the split (the optimizer
    update, counted once per micro-batch, is over-counted the more: well under 1% of an LM's FLOPs)."""
    unrolled = planned.unrolled_groups_backend
    if unrolled is None:
        raise ValueError("scanned_run_cost needs the plan of a run that scans its layers (model.scan_layers)")
    one, split = counted_copy(planned, lambda split: unrolled(1, split), slices)
    two, split = counted_copy(planned, lambda split: unrolled(2, split), slices, split)
    return {
        key: float(one.get(key, 0.0))
        + (planned.scan_groups * layer_share - 1) * (float(two.get(key, 0.0)) - float(one.get(key, 0.0)))
        for key in (*COST_KEYS, DCN_KEY)
        if key in one
    }


def counted_copy(
    planned: Planned, copy: Callable[[int], Any], slices: int, split: int = 1
) -> tuple[dict[str, float], int]:
    """:func:`counted_cost` of the backend ``copy(split)`` builds (a copy of the run, its micro-batches split
    ``split`` ways), traced with the cross-entropy's chunk loops unrolled, its ``COST_KEYS`` per micro-batch of the
    run, and the split it was compiled on: ``split`` or, where the TPU compiler refuses that program for HBM, the
    least power of two above it that brings the refused temporaries under HBM (they shrink with the rows), doubled
    while still refused."""
    while True:
        try:
            with counted_whole():
                cost = counted_cost(_compile(copy(split), planned, counted=True), slices)
            return {key: value * split if key in COST_KEYS else value for key, value in cost.items()}, split
        except jax.errors.JaxRuntimeError as exc:
            required, available = _required_temporaries(str(exc)), _available_hbm(str(exc))
            if required is None:
                raise
            split = max(2 * split, 1 << int(np.ceil(np.log2(split * required / (available or required)))))
        rows = planned.global_batch_size // planned.step.micro_batches
        if rows % split:
            raise ConfigError(
                f"the run compiles, but the copy of it that counts its FLOPs (layers and cross-entropy chunks "
                f"unrolled) does not fit in HBM, and its {rows} rows a micro-batch do not split {split} ways; "
                f"plan it with train.micro_batches={planned.step.micro_batches * split} or more"
            )


def _required_temporaries(message: str) -> int | None:
    """The temporaries' bytes from the TPU compiler's refusal of a program that does not fit in HBM, or None
    for another error ("... memory required for HLO temporaries (114.76G) exceeds available HBM (95.74G)")."""
    found = re.search(r"RESOURCE_EXHAUSTED.*?temporaries \(([0-9.]+)([KMGT])\)", message)
    return None if found is None else _bytes(found)


def _available_hbm(message: str) -> int | None:
    """The HBM a refusal (:func:`_required_temporaries`) says the program had, or None where it does not say."""
    found = re.search(r"available HBM \(([0-9.]+)([KMGT])\)", message)
    return None if found is None else _bytes(found)


def _bytes(found: re.Match) -> int:
    return int(float(found.group(1)) * 1024 ** "KMGT".index(found.group(2)) * 1024)


def attention_kernel_of(compiled: jax.stages.Compiled, trains_tokens: bool) -> str | None:
    """The attention kernel in a compiled language model's program (read from its HLO: the Pallas splash kernels
    or cuDNN's fused attention; neither is XLA's own); None for other models."""
    if not trains_tokens:
        return None
    text = compiled.as_text() or ""
    return "splash" if "splash_mha" in text else "cudnn" if "__cudnn$fmha" in text else "xla"


def expert_kernel_of(compiled: jax.stages.Compiled, model_config: Any, expert_shards: int = 1) -> str | None:
    """How a mixture of experts' expert matmuls compiled: ``ragged_dot kernel`` (XLA's grouped Mosaic kernel on
    TPU, for the forward pass and the tokens' gradient; the expert weights' gradient is decomposed densely),
    ``ragged_dot decomposed`` (XLA computes every expert densely, masked), ``dense`` (``moe_dispatch: dense``);
    with experts sharded over ``mesh.expert``, how the rows reach them (``ragged all-to-all`` on TPU and GPU,
    ``all-gathered`` on CPU: :mod:`functrain.models.moe.expert_parallel`); None for a model without experts."""
    if not isinstance(model_config, MoeOptions):
        return None
    if model_config.moe_dispatch == "dense":
        return "dense"
    text = compiled.as_text() or ""
    kernel = "ragged_dot kernel" if "ragged-dot" in text else "ragged_dot decomposed"
    if expert_shards == 1:
        return kernel
    exchange = "ragged all-to-all" if "ragged-all-to-all" in text else "all-gathered"
    return f"{kernel}; rows sent to {expert_shards} expert shards by {exchange}"


def report(
    planned: Planned,
    compiled: jax.stages.Compiled | None,
    temporaries: int = 0,
    cost: dict[str, float] | None = None,
    device_kind: str | None = None,
    slices: int = 1,
    dcn_gbps: float = DEFAULT_DCN_GBPS,
) -> Plan:
    """The :class:`Plan` of a compiled train call; without one (the compiler refused a program that needs
    ``temporaries`` bytes more than HBM holds) memory is state + batch + temporaries and FLOPs are unknown (0).
    ``cost``: the step's FLOPs and bytes when not the compiled program's count (a scanned run's,
    :func:`scanned_run_cost`); ``device_kind``: the chip's name when not the devices' own (:func:`chip_name`);
    ``slices``: the TPU slices the run spans, whose DCN bytes (in ``cost``, for a whole call) take their time at
    ``dcn_gbps`` per chip."""
    backend, step = planned.backend, planned.step
    chips, device_kind = len(backend.devices), device_kind or backend.devices[0].device_kind
    chip = chip_of(device_kind)
    if compiled is None:
        sizes = per_chip_bytes(
            backend, _RefusedMemory(backend, planned.example_batch, planned.steps_per_call, temporaries)
        )
        cost = {}
    else:
        sizes = per_chip_bytes(backend, compiled.memory_analysis())
        cost = cost or _first(compiled.cost_analysis())
    flops = float(cost.get("flops", 0.0)) * step.micro_batches
    bytes_accessed = float(cost.get("bytes accessed", 0.0)) * step.micro_batches
    tokens = planned.tokens_per_step
    shape = planned.model_config.decoder_shape() if tokens else None
    model_flops = train_flops_per_token(shape, planned.seq_len) * tokens if shape and tokens else None
    attention = None if compiled is None else attention_kernel_of(compiled, tokens is not None)
    if attention == "splash" and shape and tokens:
        # cost_analysis does not see into a Pallas kernel: add the attention FLOPs it computes (causal: half the
        # score matrix, forward and backward, and the forward again where the blocks are rematerialised: no remat
        # policy saves a kernel's output), else the roofline would leave attention out.
        attention_flops = train_flops_per_token(shape, planned.seq_len) - train_flops_per_token(shape, 0)
        recomputed = planned.model_config.remat_policy() not in (None, "none")
        flops += attention_flops * (4 / 3 if recomputed else 1) * tokens / chips
    step_time = mfu = tokens_per_chip = fits = hbm = None
    if chip:
        hbm = chip.hbm_bytes
        if compiled is not None:
            step_time = max(flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth)
            mfu = (model_flops or flops * chips) / (chips * chip.peak_flops * step_time) if step_time else None
            tokens_per_chip = tokens / step_time / chips if tokens and step_time else None
        fits = compiled is not None and sizes["total"] <= HBM_USABLE * hbm
    dcn = dcn_figures(cost.get(DCN_KEY), planned.steps_per_call, dcn_gbps, step_time)
    mesh = {axis: int(size) for axis, size in backend.mesh.shape.items()}
    schedule = pipeline_schedule_of(planned)
    pipeline: dict[str, Any] = {}
    if schedule is not None:
        pipeline = dict(pipeline_repeats=schedule[1], pipeline_microbatches=schedule[2])
        pipeline["pipeline_bubble"] = bubble_fraction(*schedule)
    parameters = sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(backend.abstract_state.params))
    return Plan(
        device_kind=device_kind,
        chips=chips,
        mesh=mesh,
        parameters=parameters,
        seq_len=planned.seq_len,
        global_batch_size=planned.global_batch_size,
        micro_batches=step.micro_batches,
        steps_per_call=planned.steps_per_call,
        per_chip_bytes=sizes,
        hbm_bytes=hbm,
        flops_per_step=flops,
        bytes_per_step=bytes_accessed,
        model_flops_per_step=model_flops,
        step_time_s=step_time,
        mfu=mfu,
        tokens_per_sec_per_chip=tokens_per_chip,
        fits=fits,
        compiled=compiled is not None,
        layers_scanned=planned.scan_groups > 0,
        advice=advice(planned, sizes, chips, mesh) if fits is False else [],
        attention=attention,
        experts=None if compiled is None else expert_kernel_of(compiled, planned.model_config, mesh.get("expert", 1)),
        slices=slices,
        **dcn,
        **pipeline,
    )


def dcn_figures(
    call_bytes: float | None, steps_per_call: int, dcn_gbps: float, step_time: float | None
) -> dict[str, Any]:
    """A plan's DCN fields from the bytes a chip sends over DCN in one call of ``steps_per_call`` steps (None: the
    run spans one slice, or its program was refused): per step, their time at ``dcn_gbps`` Gbit/s, and whether
    that time fits under the roofline ``step_time`` (the transfers overlap the compute)."""
    if call_bytes is None:
        return {}
    per_step = call_bytes / steps_per_call
    seconds = per_step * 8 / (dcn_gbps * 1e9)
    hidden = None if step_time is None else seconds <= step_time
    return dict(dcn_bytes_per_step=per_step, dcn_gbps=dcn_gbps, dcn_time_s=seconds, dcn_hidden=hidden)
