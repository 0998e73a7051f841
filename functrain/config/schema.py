"""The whole run config: :class:`RunSections` (every section but the tasks', and the checks that read several
sections at once) and :class:`Config`, the same with a section per registered task.

``load_config("configs/char_gpt.yaml", ["train.max_steps=100"])`` (:mod:`functrain.config.load`) returns a
validated :class:`Config`; the sections themselves are in :mod:`functrain.config.sections`, the ``model`` union in
:mod:`functrain.config.model_section`.
"""

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import Field

from functrain.config.model_section import TARGET_TAG, ModelSection, dense_moe_refusal, model_section_tag
from functrain.config.pipeline import PipelineConfig, divisors, pipeline_problem
from functrain.config.sections import (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    MeshConfig,
    OptimizerConfig,
    ProfileConfig,
    RunConfig,
    TrainConfig,
)
from functrain.core.capabilities import backends_with, capabilities_of
from functrain.core.section import Section
from functrain.models import family_named, family_names, family_of, model_config_class
from functrain.models.configs.base import ModelConfig
from functrain.models.configs.moe import MoeOptions
from functrain.models.options import RuntimeOptions, scan_refusal


class RunSections(Section):
    """The whole run configuration but the tasks' sections (:class:`Config` adds one per registered task);
    ``model`` holds the chosen model's own validated config; ``task`` names the training mode
    (:mod:`functrain.tasks`; None: what the data implies)."""

    seed: int = 0
    backend: Literal["jax", "torch"] = "jax"
    task: str | None = None
    run: RunConfig = RunConfig()
    # Every validated config has one (_check_model_fits_data names a missing one): None is a default only.
    model: ModelSection = None  # type: ignore[assignment]
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    pipeline: PipelineConfig = PipelineConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    profile: ProfileConfig = ProfileConfig()
    # Keys given under an old name (``preference.init_from``) -> that name, for messages about them.
    _given_as: dict[str, str] = pydantic.PrivateAttr(default_factory=dict)

    @pydantic.field_validator("task")
    @classmethod
    def _known_task(cls, value: str | None) -> str | None:
        from functrain.tasks import check_task_name

        return value if value is None else check_task_name(value)

    @pydantic.field_validator("model", mode="before")
    @classmethod
    def _refuse_unnamed_model(cls, value: Any) -> Any:
        # The one-line refusals a section gets before the union picks its member (model_section_tag).
        if isinstance(value, ModelConfig):
            return value
        if isinstance(value, dict) and value.get("scan_layers") and "name" not in value:
            raise ValueError(scan_refusal(f"target {value.get('target')!r}"))  # a user model's own layout
        if (
            isinstance(value, dict)
            and value.get("scan_layers")
            and isinstance(value.get("name"), str)
            and not family_named(value["name"]).scans_layers
        ):
            raise ValueError(scan_refusal(value["name"]))
        if isinstance(value, dict) and TARGET_TAG in value and "name" in value:
            raise ValueError("the model section has both 'name' and 'target'; keep one")
        if isinstance(value, dict) and "name" in value:
            model_config_class(value["name"])  # an unknown name: the registry's error, naming the known ones
        elif model_section_tag(value) is None:
            raise ValueError(
                "the model section needs a 'name' (one of the registered models) or a 'target' "
                "('package.module:factory')"
            )
        return value

    @pydantic.model_validator(mode="after")
    def _check_model_fits_data(self) -> "RunSections":
        if self.model is None:
            raise ValueError(
                "the config has no model section; add model.name (e.g. model.name=mlp) or "
                "model.target, or pass model= to fit"
            )
        context = self.model.max_positions()
        if context is not None and self.data.seq_len > context:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} is longer than the model's context of {context} "
                f"positions; lower data.seq_len or raise the model's context length"
            )
        vocab = self.model.vocabulary_size()
        if (
            self.data.target is None
            and self.data.sources is None
            and self.data.name == "char_text"
            and vocab is not None
            and vocab < 256
        ):
            raise ValueError(
                f"data.name=char_text feeds bytes (ids 0-255) but the model's vocab_size is {vocab}; "
                f"set model.vocab_size to at least 256"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_expert_mesh(self) -> "RunSections":
        ways = self.mesh.expert
        if ways == 1 or self.model is None:
            return self
        if not isinstance(self.model, MoeOptions):
            name = self.model.registry_name()
            if name is None:  # a user model may name an "expert" logical axis of its own
                return self
            raise ValueError(dense_moe_refusal(f"mesh.expert={ways}", name, fix="set mesh.expert=1"))
        experts = self.model.expert_count()
        if ways > 1 and experts % ways:
            raise ValueError(
                f"mesh.expert={ways} does not divide the model's {experts} experts "
                f"(model.{self.model.expert_count_key}); use one of {divisors(experts)}"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _check_pipeline(self) -> "RunSections":
        problem = pipeline_problem(self) if self.model is not None else None
        if problem:
            raise ValueError(problem)
        return self

    @pydantic.model_validator(mode="after")
    def _check_context_mesh(self) -> "RunSections":
        ways = self.mesh.context
        if ways == 1 or self.model is None:
            return self
        if not capabilities_of(self.backend).context_parallel:
            splitting = " or ".join(backends_with("context_parallel"))
            raise ValueError(
                f"mesh.context={ways} splits the sequence in backend: {splitting} only; set mesh.context=1"
            )
        family = family_of(self.model)
        if family is None or not family.context_parallel:
            name = self.model.registry_name() or "a user model (model.target or a model given to fit)"
            raise ValueError(
                f"mesh.context={ways} needs a model whose attention splits the sequence "
                f"({', '.join(family_names('context_parallel'))}) and {name} has none; set mesh.context=1"
            )
        if isinstance(self.model, MoeOptions) and self.model.capacity_factor is not None:
            raise ValueError(
                f"mesh.context={ways} with model.capacity_factor={self.model.capacity_factor}: each device routes "
                f"two chunks of every sequence, so which selections a capacity drops would depend on the split; "
                f"set model.capacity_factor=null (dropless) or mesh.context=1"
            )
        length = self.data.seq_len
        if length % (2 * ways):
            raise ValueError(
                f"data.seq_len={length} does not split into 2 x mesh.context={ways} equal chunks (each device "
                f"holds one from the start and one from the end); make data.seq_len a multiple of {2 * ways}"
            )
        # The kernels' modules import flax: only a context-parallel config reads them (a config validates without
        # model code otherwise).
        from functrain.models.attention import splash_available
        from functrain.models.splash import LANES

        attention = self.model.attention if isinstance(self.model, RuntimeOptions) else "xla"
        splash = attention == "splash" or (attention == "auto" and splash_available())
        if splash and (length // ways) % LANES:
            raise ValueError(
                f"data.seq_len={length} over mesh.context={ways} leaves {length // ways} tokens a device, which "
                f"splash attention's {LANES}-token blocks do not divide; make data.seq_len a multiple of "
                f"{LANES * ways} or set model.attention=xla"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _resolve_task(self) -> "RunSections":
        """The task the data implies when none is named; a task's section given for another task is refused;
        the running task's moved keys (``preference.init_from``) land where they live now."""
        from functrain.tasks import implied_task, task_sections

        if self.task is None:
            self.__dict__["task"] = implied_task(self)  # plain set: assignment would validate the model again
        for name, section_class in task_sections().items():
            # A section at its defaults configures nothing (older run configs record every task's section).
            if name != self.task and getattr(self, name) != section_class():
                raise ValueError(
                    f"the {name} section configures task {name} and this config trains "
                    f"{self.task or 'a classifier or causal LM (no task set)'}; set task: {name} or "
                    f"remove the {name} section"
                )
        section = getattr(self, self.task, None) if self.task else None
        for dotted, (own_key, value) in section.aliases().items() if section is not None else ():
            where, key = dotted.split(".")
            current, old_name = getattr(getattr(self, where), key), f"{self.task}.{own_key}"
            if current is not None and current != value:
                raise ValueError(
                    f"{old_name}={value!r} and {dotted}={current!r} differ; {old_name} is the old "
                    f"name of {dotted}: keep {dotted} alone"
                )
            getattr(self, where).__dict__[key] = value
            self._given_as[dotted] = old_name
        return self

    def given_as(self, dotted: str) -> str:
        """The name the config gave ``dotted`` under (an old alias), for messages about its value."""
        return self._given_as.get(dotted, dotted)

    @pydantic.model_validator(mode="after")
    def _check_intervals(self) -> "RunSections":
        k = self.train.steps_per_call
        for key, every in (
            ("log.every_steps", self.log.every_steps),
            ("eval.every_steps", self.eval.every_steps),
            ("checkpoint.every_steps", self.checkpoint.every_steps),
            ("checkpoint.local_every_steps", self.checkpoint.local_every_steps),
        ):
            if every and every % k:
                raise ValueError(
                    f"{key}={every} is not a multiple of train.steps_per_call={k}: intervals fall "
                    f"on call boundaries; use a multiple of {k} for {key}"
                )
        self._check_local_checkpoints()
        from functrain.data.loader import batch_split_problem

        problem = batch_split_problem(self.data.global_batch_size, self.train.micro_batches)
        if problem:
            raise ValueError(problem)
        if self.train.loss_scale == "dynamic" and self.train.compute_dtype != "float16":
            raise ValueError("train.loss_scale=dynamic is for train.compute_dtype=float16; set one or the other")
        for key, asked in (
            ("param_dtype", self.train.param_dtype != "float32"),
            ("offload_optimizer", self.train.offload_optimizer),
            ("fp8", self.train.fp8),
        ):
            if asked and self.backend not in (able := backends_with(key)):
                raise ValueError(f"train.{key} is for backend: {' or '.join(able)}; remove it or set backend={able[0]}")
        if self.train.torch_compile and not capabilities_of(self.backend).torch_compile:
            compiling = backends_with("torch_compile")
            raise ValueError(
                f"train.torch_compile=true is for backend: {' or '.join(compiling)} (backend is {self.backend}; the "
                f"jax step is always compiled); remove it or set backend={compiling[0]}"
            )
        return self

    def _check_local_checkpoints(self) -> None:
        checkpoint = self.checkpoint
        if checkpoint.local_every_steps and not checkpoint.local_dir:
            raise ValueError(
                "checkpoint.local_every_steps needs checkpoint.local_dir (a directory on fast local storage, "
                "e.g. /dev/shm/functrain); set it or remove local_every_steps"
            )
        if checkpoint.local_dir is None:
            return
        if not checkpoint.local_every_steps:
            raise ValueError(
                "checkpoint.local_dir needs checkpoint.local_every_steps (how often to save locally); set it "
                "or remove local_dir"
            )
        local, run_dir = Path(checkpoint.local_dir).absolute(), Path(self.run.dir).absolute()
        if local == run_dir or run_dir in local.parents:
            raise ValueError(
                f"checkpoint.local_dir={checkpoint.local_dir!r} is inside run.dir={self.run.dir!r}: local "
                f"checkpoints belong on each machine's own fast storage (a local disk or /dev/shm), apart from "
                f"the persistent run directory; choose a directory outside it"
            )
        if not capabilities_of(self.backend).local_checkpoints:
            saving = backends_with("local_checkpoints")
            raise ValueError(f"checkpoint.local_dir saves the JAX state's shards; set backend={saving[0]} or remove it")

    def section(self, task: str) -> Any:
        """The config section of task ``task``."""
        return getattr(self, task)

    def to_dict(self) -> dict:
        """The resolved config as plain data (what ``config.yaml`` in the run directory holds): the task's own
        section, not the other tasks'."""
        from functrain.tasks import task_sections

        return self.model_dump(mode="json", exclude={name for name in task_sections() if name != self.task})

    def digest(self) -> str:
        """SHA-256 of the resolved config, recorded in checkpoints."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


_CONFIG_CLASSES: dict[tuple[str, ...], type[RunSections]] = {}


def config_class() -> type[RunSections]:
    """The run config's class: :class:`RunSections` with a top-level section per registered task, named after it
    (``preference``, ``distill``), made again when a task registers at run time
    (:func:`functrain.tasks.register_task`)."""
    from functrain.tasks import task_sections

    sections = task_sections()
    key = tuple(sorted(sections))
    if key not in _CONFIG_CLASSES:
        fields: dict[str, Any] = {name: (section, Field(default_factory=section)) for name, section in sections.items()}
        _CONFIG_CLASSES[key] = pydantic.create_model(
            "Config",
            __base__=RunSections,
            __module__=__name__,
            __doc__="The whole run configuration, the tasks' sections included.",
            **fields,
        )
    return _CONFIG_CLASSES[key]


if TYPE_CHECKING:
    Config = RunSections
else:
    Config = config_class()  # the registry's tasks as the package ships them; isinstance checks use RunSections
