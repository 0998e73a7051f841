"""The pipeline's config: the ``pipeline`` section (``pipeline.repeats``), what a run must be to pipeline its
layers (``mesh.pipeline`` / ``mesh.dcn_pipeline`` stages) and the schedule the backend traces its model under
(:mod:`functrain.parallel.pipeline`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import Field

from functrain.core.capabilities import backends_with, capabilities_of
from functrain.core.section import Section
from functrain.errors import ConfigError
from functrain.models import family_names, family_of

if TYPE_CHECKING:
    from functrain.parallel.pipeline import PipelineSchedule


class PipelineConfig(Section):
    """``pipeline.*``: ``repeats``, the chunks of layers each stage holds (the circular schedule: a micro-batch
    passes through the stages ``repeats`` times; 1 is GPipe). The stage count is ``mesh.pipeline`` x
    ``mesh.dcn_pipeline``; the micro-batches are ``train.pipeline_microbatches``."""

    repeats: int = Field(1, ge=1)


def divisors(count: int) -> str:
    """``count``'s divisors as a list for a message (``"1, 2, 3, 6"``)."""
    return ", ".join(str(d) for d in range(1, count + 1) if count % d == 0)


def pipeline_problem(config: Any) -> str | None:
    """Why ``config`` cannot pipeline its layers over its stages (one line naming the key and the fix), or None."""
    stages = config.mesh.pipeline_stages()
    if stages == 1:
        return None
    where = f"mesh.pipeline={config.mesh.pipeline} x mesh.dcn_pipeline={config.mesh.dcn_pipeline} ({stages} stages)"
    if not capabilities_of(config.backend).pipeline:
        pipelining = backends_with("pipeline")
        return f"{where} pipelines the JAX backend's scanned layers; set backend={pipelining[0]} or mesh.pipeline=1"
    from functrain.models.scan import layer_period  # flax: a config without a pipeline validates without it

    model = config.model
    if model.lora_settings() is not None:  # the stacked adapters are not run through the stages' schedule yet
        return f"{where} splits the scanned layers and model.lora's adapters are not pipelined; set mesh.pipeline=1"
    name = model.registry_name() or "given to this run"
    kinds = model.pipelined_layer_kinds()
    if kinds is None:
        return f"{where} splits a model's scanned layers and model {name} does not scan its layers; set mesh.pipeline=1"
    family = family_of(model)
    if family is not None and not family.pipeline:
        return (
            f"{where} splits a model's scanned layers and model {name} does not pipeline them (only "
            f"{', '.join(family_names('pipeline'))} do); set mesh.pipeline=1"
        )
    if not kinds:
        return f"{where} splits the mixture-of-experts layers and model {name} has none; set mesh.pipeline=1"
    if not model.layers_scanned():
        return f"{where} splits the scanned layers; set model.scan_layers=true"
    groups = len(kinds) // layer_period(kinds)
    repeats = config.pipeline.repeats
    if groups % (stages * repeats):
        period = layer_period(kinds)
        unit = "layers" if period == 1 else f"groups of {period} layers"
        return (
            f"{where} x pipeline.repeats={repeats} does not divide the model's {groups} {unit}; "
            f"make stages x repeats one of {divisors(groups)}"
        )
    return None


def pipeline_schedule(config: Any, batch_ways: int) -> PipelineSchedule:
    """The schedule the backend traces under; a ConfigError when ``train.pipeline_microbatches`` (default: the
    stage count) does not divide the batch each of the ``batch_ways`` data-parallel replicas computes."""
    from functrain.parallel.pipeline import PipelineSchedule

    stages = config.mesh.pipeline_stages()
    microbatches = config.train.pipeline_microbatches or stages
    if stages > 1:
        per_replica = config.data.global_batch_size // (config.train.micro_batches * batch_ways)
        if per_replica % microbatches:
            key = f"train.pipeline_microbatches={microbatches}"
            if config.train.pipeline_microbatches is None:
                key += " (the default: one per stage)"
            raise ConfigError(
                f"{key} does not divide the {per_replica} rows each data-parallel replica computes per step "
                f"(data.global_batch_size / train.micro_batches / {batch_ways} replicas); "
                f"set train.pipeline_microbatches to one of {divisors(per_replica)}"
            )
    return PipelineSchedule(repeats=config.pipeline.repeats, microbatches=microbatches)
