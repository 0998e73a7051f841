"""Scan over layers (``model.scan_layers``): a decoder's layers as one ``nn.scan`` over stacked parameters.

Unrolled, a model of ``n`` layers traces and compiles ``n`` copies of its block; scanned, XLA compiles the block
once, so compile time stops growing with depth, and the backward pass keeps one layer's temporaries at a time.

Layers that differ (Gemma 2's alternating local/global windows, Gemma 3's 5 local : 1 global with its own RoPE,
Qwen2's windows) are scanned by their repeating *group*: ``period`` consecutive layers whose settings repeat
through the stack. The body applies the group's ``period`` blocks, each with the settings of its layer, so the
scanned model computes what the unrolled one does; layers after the last whole group stay unrolled.

Parameter layout (what :mod:`functrain.models.stacking` converts to and from the unrolled ``{prefix}{i}``)::

    {prefix}stack/slot_{j}/...   leading axis "layers" of length groups: layer g * period + j at index g
    {prefix}{i}/...               the unrolled remainder, i >= groups * period
"""

from typing import Any, Callable, Hashable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from functrain.models.configs.base import ModelConfig
from functrain.models.stacking import SLOT_PREFIX, STACK_SUFFIX
from functrain.parallel.pipeline import current_schedule, pipeline_layers, stage_count
from functrain.parallel.sharding import constrain_batch

LAYERS_AXIS = "layers"  # the logical name of the stacked axis: split over the pipeline stages (sharding.DEFAULT_RULES)

MakeBlock = Callable[[int, str], nn.Module]  # (layer index, module name) -> a block module


def layer_period(kinds: Sequence[Hashable]) -> int:
    """The smallest ``p`` with ``kinds[i] == kinds[i % p]`` for every layer ``i`` (``kinds``: what sets each
    layer apart, e.g. its attention window): the group a scan repeats."""
    count = len(kinds)
    return next(p for p in range(1, count + 1) if all(kinds[i] == kinds[i % p] for i in range(count)))


class _Group(nn.Module):
    """One scan step: the ``period`` blocks of a group, block ``j`` built as layer ``j`` (its settings are those
    of every layer ``g * period + j``)."""

    make_block: MakeBlock
    period: int
    leading_args: tuple = ()  # Python values (e.g. GPT's ``deterministic``) passed before the scanned inputs
    collect: bool = False  # blocks return (x, per-layer output): stacked [period, ...]
    layer_inputs: bool = False  # the last argument is the group's layers' own inputs, [period, ...]

    @nn.compact
    def __call__(self, x: jax.Array, *args: Any) -> tuple[jax.Array, Any]:
        outputs = []
        for j in range(self.period):
            own = (args[-1][j],) if self.layer_inputs else ()
            shared = args[:-1] if self.layer_inputs else args
            block = self.make_block(j, f"{SLOT_PREFIX}{j}")
            x, output = _split(block(x, *self.leading_args, *shared, *own), self.collect)
            outputs.append(output)
        return x, _stack(outputs) if self.collect else None


def _split(result: Any, collect: bool) -> tuple[jax.Array, Any]:
    """A block's hidden states (batch-constrained) and its per-layer output (None unless ``collect``)."""
    x, output = result if collect else (result, None)
    return constrain_batch(x), output


def _stack(outputs: list[Any]) -> Any:
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outputs)


def apply_layers(
    x: jax.Array,
    *,
    kinds: Sequence[Hashable],
    make_block: MakeBlock,
    prefix: str,
    scan: bool,
    leading_args: tuple = (),
    args: tuple = (),
    collect: bool = False,
    pipelined: bool = True,
    layer_inputs: jax.Array | None = None,
) -> Any:
    """``x`` through ``len(kinds)`` blocks, inside a compact ``__call__``: unrolled as ``{prefix}{i}``, or with
    ``scan`` by groups of the layers' period (module docstring). ``make_block(i, name)`` builds layer ``i``
    (remat-wrapped as the model wants: a scan keeps its remat per layer); each block is called as
    ``block(x, *leading_args, *args)``. With ``collect`` each block returns ``(x, output)`` (a tree of arrays of
    the same shapes on every layer, sums over the batch's rows: a mixture of experts' router statistics) and the
    result is ``(x, outputs)``, the outputs stacked ``[layers, ...]`` in layer order. A scanned stack is split
    over the mesh's pipeline stages unless ``pipelined`` is False (then every stage runs it whole, its weights
    replicated over the stages: a few layers unlike the rest, DeepSeek-V3's dense first layers). ``layer_inputs``
    ``[layers, ...]``: each layer's own input (Gemma 4's per-layer embeddings), passed to block ``i`` after ``args`` as
    ``layer_inputs[i]`` (scanned along with the layers; not with pipeline stages, which do not split it)."""
    count = len(kinds)
    first_unrolled = 0
    outputs = []
    if scan:
        period = layer_period(kinds)
        groups = count // period
        first_unrolled = groups * period
        own: tuple = ()
        if layer_inputs is not None:  # [layers, ...] -> the scanned groups' [groups, period, ...]
            own = (layer_inputs[:first_unrolled].reshape(groups, period, *layer_inputs.shape[1:]),)
        stack = nn.scan(
            _Group,
            variable_axes={True: 0},  # every collection a block holds is per layer (params, router counts)
            split_rngs={"params": True, "dropout": True},
            in_axes=(nn.broadcast,) * len(args) + (0,) * len(own),
            length=groups,
            metadata_params={nn.PARTITION_NAME: LAYERS_AXIS if pipelined else None},
        )
        scanned = stack(make_block, period, tuple(leading_args), collect, bool(own), name=f"{prefix}{STACK_SUFFIX}")
        stages = stage_count() if pipelined else 1
        if stages > 1 and not scanned.is_initializing():  # the stack over the mesh's pipeline stages
            assert not own, "pipeline stages do not split per-layer inputs (the family declares pipeline=False)"
            x, grouped = _pipelined(scanned, make_block, period, tuple(leading_args), collect, x, args, stages)
        else:
            x, grouped = scanned(x, *args, *own)
        if collect:  # [groups, period, ...] -> [groups * period, ...]: layer g * period + j at that index
            outputs = [jax.tree.map(lambda leaf: leaf.reshape(-1, *leaf.shape[2:]), grouped)]
    for i in range(first_unrolled, count):
        own_input = () if layer_inputs is None else (layer_inputs[i],)
        x, output = _split(make_block(i, f"{prefix}{i}")(x, *leading_args, *args, *own_input), collect)
        outputs.append(jax.tree.map(lambda leaf: leaf[None], output))
    if not collect:
        return x
    return x, jax.tree.map(lambda *leaves: jnp.concatenate(leaves), *outputs)


def _pipelined(
    scanned: nn.Module,
    make_block: MakeBlock,
    period: int,
    leading_args: tuple,
    collect: bool,
    x: jax.Array,
    args: tuple,
    stages: int,
) -> tuple[jax.Array, Any]:
    """What ``scanned(x, *args)`` computes, run by :func:`functrain.parallel.pipeline.pipeline_layers` on the
    scan's own stacked variables (initialised, and checkpointed, by the scan). The collections the blocks update
    (DeepSeek-V3's router counts) must be counters: each group runs each micro-batch from zeros, and the stack's
    variables grow by the sum of what every micro-batch added, as the scan over the whole batch adds it."""
    variables = scanned.variables
    counters = [col for col in variables if col != "params" and scanned.is_mutable_collection(col)]
    dropout = scanned.make_rng("dropout") if scanned.has_rng("dropout") else None

    def apply_group(group: Any, h: jax.Array, group_args: tuple, index: jax.Array) -> tuple[jax.Array, Any]:
        rngs = {} if dropout is None else {"dropout": jax.random.fold_in(dropout, index)}
        zeros = {col: jax.tree.map(jnp.zeros_like, group[col]) for col in counters}
        module = _Group(make_block, period, leading_args, collect, parent=None)
        (h, output), added = module.apply({**group, **zeros}, h, *group_args, rngs=rngs, mutable=counters)
        return h, (output, added)

    # Blocks that return statistics are a mixture of experts': its ragged_dot cannot be batched by a vmap on TPU.
    x, (grouped, added) = pipeline_layers(
        apply_group, variables, x, args, stages=stages, schedule=current_schedule(), manual_stages=collect
    )
    for col, sums in added.items():
        for name, value in sums.items():
            scanned.put_variable(col, name, jax.tree.map(jnp.add, variables[col][name], value))
    return x, grouped


def scan_groups(model_config: ModelConfig) -> int:
    """The whole groups of layers the scan of ``model_config`` runs (0: its layers are not scanned)."""
    kinds = model_config.layer_kinds() if model_config.layers_scanned() else None
    return 0 if kinds is None else len(kinds) // layer_period(kinds)
