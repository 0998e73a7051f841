"""Plan a run before renting the hardware: compile its train call ahead of time and read what XLA says.

:func:`plan` builds the run exactly as ``functrain train`` would (the same builder, sharding rules and step; see
:func:`functrain.plan.planned.plan_run`) on abstract arrays (``jax.ShapeDtypeStruct`` with shardings: nothing the
size of the model is allocated), compiles the train call for the local devices or for a TPU topology through
libtpu, and reports per chip: state bytes by part, XLA's temporaries (activations), the total against the chip's
HBM, FLOPs and HBM bytes of a step (``cost_analysis``), a roofline step time and the MFU it implies.

FLOPs and bytes are XLA's cost analysis of that one compiled program with every loop counted once per iteration
(steps, micro-batches, scanned layers, cross-entropy chunks, pipeline iterations, collective matmuls:
:mod:`functrain.plan.counting`, which counts a kernel by its cost estimate); an attention kernel's FLOPs (splash,
cuDNN), which neither the analysis nor an estimate gives, are added from the model's shape. One compile per plan:
nothing is compiled again to count.

A pipelined run (``mesh.pipeline`` stages, :mod:`functrain.parallel.pipeline`) is counted as it runs: each chip
computes its stage's share of the layers on every iteration of the schedule, busy or idle; the bubble is reported.

Over several TPU slices (``--slices``), the bytes each chip sends over the data-centre network per step are read
from the program's transfers (:mod:`functrain.plan.dcn`), with their time at a DCN bandwidth.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import numpy as np

from functrain.config.schema import Config
from functrain.core.precision import is_quantized
from functrain.errors import ConfigError
from functrain.models.configs.moe import MoeOptions
from functrain.models.quantized import weight_count
from functrain.parallel.chips import chip_of
from functrain.parallel.pipeline import PIPELINE_AXIS, bubble_fraction, microbatch_count
from functrain.parallel.platform import describe_host_to_libtpu
from functrain.parallel.sharding import state_bytes_per_device
from functrain.plan.counting import DCN_KEY, step_cost
from functrain.plan.planned import Planned, plan_run
from functrain.report.mfu import train_flops_per_token

TOPOLOGY_EXAMPLES = ("v4:2x2x2", "v5e:4x4", "v5p:4x4x8", "v6e:16x16")
# Part of HBM a plan may fill: the runtime, the compiled program and fragmentation take the rest.
HBM_USABLE = 0.95
# The attention kernels (attention_kernel_of) whose FLOPs a plan adds from the model's shape (attention_kernel_flops).
ATTENTION_KERNELS = ("splash", "cudnn")
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
        return list(
            topologies.get_topology_desc(
                platform="tpu", topology_name=name, num_slices=slices, **_small_host_bounds(name)
            ).devices
        )
    except Exception as exc:  # noqa: BLE001 -- libtpu: XlaRuntimeError/JaxRuntimeError/ValueError
        raise ConfigError(
            f"unknown TPU topology {name!r} ({str(exc).splitlines()[0][:120]}); give GENERATION:SHAPE, "
            f"one of the generations v4, v5e, v5p, v6e, e.g. {', '.join(TOPOLOGY_EXAMPLES)}"
        ) from None


def _small_host_bounds(name: str) -> dict[str, Any]:
    """libtpu's keyword for a topology of fewer chips than its default host (2x2x1: ``v5e:1x1``, one v5e chip,
    which it otherwise refuses as not divisible by that host): a host of the topology's own shape."""
    dims = [int(dim) for dim in name.partition(":")[2].split("x") if dim.isdigit()]
    if not dims or math.prod(dims) >= 4:
        return {}
    return {"chips_per_host_bounds": tuple((dims + [1, 1])[:3])}


@dataclass(frozen=True)
class Plan:
    """What one compile of a run's train call says, per chip (bytes, FLOPs) unless named otherwise."""

    device_kind: str
    chips: int
    mesh: dict[str, int]
    parameters: int  # weights, a quantized one counted as one (not by its bytes)
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
    layers_scanned: bool = False  # model.scan_layers: the layers are a loop (counted once per layer group)
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
    quantized_base_bytes: int | None = None  # per chip, within params: a QLoRA base's codes and scales (None: none)

    def to_json(self) -> dict[str, Any]:
        """The plan as one JSON-able object (``functrain plan --json``)."""
        return asdict(self)


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


def quantized_base_bytes(backend: Any) -> int | None:
    """Per chip, the bytes of the params' quantized weights (a QLoRA base: codes and scales, from their shardings);
    None when the params hold none."""
    params = jax.tree.leaves(backend.abstract_state.params, is_leaf=is_quantized)
    shardings = jax.tree.leaves(backend.state_shardings.params, is_leaf=is_quantized)
    quantized = [(node, sharding) for node, sharding in zip(params, shardings) if is_quantized(node)]
    if not quantized:
        return None
    return sum(state_bytes_per_device(node, sharding)[0] for node, sharding in quantized)


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
    config: Config,
    topology: str | None = None,
    slices: int | None = None,
    dcn_gbps: float = DEFAULT_DCN_GBPS,
    devices: list | None = None,
) -> Plan:
    """Compile ``config``'s train call for the local devices or TPU ``topology`` (``slices`` of it joined over DCN,
    spanned by ``mesh.dcn_data`` x ``mesh.dcn_fsdp`` x ``mesh.dcn_pipeline``) and report (see the module);
    ``dcn_gbps``: the DCN bandwidth per chip the DCN time is computed at; ``devices``: the topology's devices when
    the caller has them already (:func:`topology_devices`: plans of several candidates describe it once)."""
    check_slices(topology, slices, dcn_gbps)
    slices = slices or 1
    if topology and devices is None:
        devices = topology_devices(topology, slices)
    planned = plan_run(config, devices if topology else None)
    device_kind = chip_name(topology) if topology else None
    try:
        compiled = _compile(planned)
    except jax.errors.JaxRuntimeError as exc:
        required = _required_temporaries(str(exc))
        if required is None:
            raise
        return report(planned, None, temporaries=required, device_kind=device_kind)
    return report(planned, compiled, device_kind=device_kind, slices=slices, dcn_gbps=dcn_gbps)


def _compile(planned: Planned) -> jax.stages.Compiled:
    """The run's train call compiled for its abstract arguments (the one backend compile of a plan)."""
    backend = planned.backend
    return backend.compile_train_call(*backend.abstract_train_args(planned.example_batch, planned.steps_per_call))


def pipeline_schedule_of(planned: Planned) -> tuple[int, int, int] | None:
    """``(stages, repeats, micro-batches)`` of a pipelined run's schedule; None when its layers are not pipelined."""
    backend = planned.backend
    stages = int(backend.mesh.shape.get(PIPELINE_AXIS, 1))
    if stages == 1:
        return None
    rows = planned.global_batch_size // planned.step.micro_batches
    return stages, backend.pipeline.repeats, microbatch_count(backend.pipeline.microbatches, stages, rows)


def _required_temporaries(message: str) -> int | None:
    """The temporaries' bytes from the TPU compiler's refusal of a program that does not fit in HBM, or None
    for another error ("... memory required for HLO temporaries (114.76G) exceeds available HBM (95.74G)")."""
    found = re.search(r"RESOURCE_EXHAUSTED.*?temporaries \(([0-9.]+)([KMGT])\)", message)
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
    device_kind: str | None = None,
    slices: int = 1,
    dcn_gbps: float = DEFAULT_DCN_GBPS,
) -> Plan:
    """The :class:`Plan` of a compiled train call; without one (the compiler refused a program that needs
    ``temporaries`` bytes more than HBM holds) memory is state + batch + temporaries and FLOPs are unknown (0).
    ``device_kind``: the chip's name when not the devices' own (:func:`chip_name`); ``slices``: the TPU slices the
    run spans, whose DCN bytes take their time at ``dcn_gbps`` per chip."""
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
        cost = step_cost(compiled, planned.steps_per_call, slices)
    tokens = planned.tokens_per_step
    shape = planned.model_config.decoder_shape() if tokens else None
    model_flops = train_flops_per_token(shape, planned.seq_len) * tokens if shape and tokens else None
    attention = None if compiled is None else attention_kernel_of(compiled, tokens is not None)
    kernel = attention in ATTENTION_KERNELS
    flops = cost.get("flops", 0.0) + (attention_kernel_flops(planned) / chips if kernel else 0.0)
    bytes_accessed = cost.get("bytes accessed", 0.0)
    step_time = mfu = tokens_per_chip = fits = hbm = None
    if chip:
        hbm = chip.hbm_bytes
        if compiled is not None:
            step_time = max(flops / chip.peak_flops, bytes_accessed / chip.hbm_bandwidth)
            mfu = (model_flops or flops * chips) / (chips * chip.peak_flops * step_time) if step_time else None
            tokens_per_chip = tokens / step_time / chips if tokens and step_time else None
        fits = compiled is not None and sizes["total"] <= HBM_USABLE * hbm
    dcn = dcn_figures(cost.get(DCN_KEY), dcn_gbps, step_time)
    mesh = {axis: int(size) for axis, size in backend.mesh.shape.items()}
    schedule = pipeline_schedule_of(planned)
    pipeline: dict[str, Any] = {}
    if schedule is not None:
        pipeline = dict(pipeline_repeats=schedule[1], pipeline_microbatches=schedule[2])
        pipeline["pipeline_bubble"] = bubble_fraction(*schedule)
    parameters = weight_count(backend.abstract_state.params)
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
        quantized_base_bytes=quantized_base_bytes(backend),
    )


def attention_kernel_flops(planned: Planned) -> float:
    """The attention FLOPs of a step that an attention kernel computes (splash's Pallas kernels, cuDNN's fused
    attention: ``ATTENTION_KERNELS``), on all chips (0 for a run that trains no decoder on tokens): the cost analysis
    does not see into a kernel, else the roofline would leave attention out. Causal: half the score matrix, forward
    and backward, and the forward again where the blocks are rematerialised (no remat policy saves a kernel's
    output)."""
    tokens = planned.tokens_per_step
    shape = planned.model_config.decoder_shape() if tokens else None
    if not shape or not tokens:
        return 0.0
    attention_flops = train_flops_per_token(shape, planned.seq_len) - train_flops_per_token(shape, 0)
    recomputed = planned.model_config.remat_policy() not in (None, "none")
    return attention_flops * (4 / 3 if recomputed else 1) * tokens


def dcn_figures(step_bytes: float | None, dcn_gbps: float, step_time: float | None) -> dict[str, Any]:
    """A plan's DCN fields from the bytes a chip sends over DCN in a step (None: the run spans one slice, or its
    program was refused): their time at ``dcn_gbps`` Gbit/s, and whether that time fits under the roofline
    ``step_time`` (the transfers overlap the compute)."""
    if step_bytes is None:
        return {}
    seconds = step_bytes * 8 / (dcn_gbps * 1e9)
    hidden = None if step_time is None else seconds <= step_time
    return dict(dcn_bytes_per_step=step_bytes, dcn_gbps=dcn_gbps, dcn_time_s=seconds, dcn_hidden=hidden)
