"""Typed run configuration: YAML files, dotted command-line overrides, one-line errors.

``load_config("configs/char_gpt.yaml", ["train.max_steps=100"])`` returns a validated :class:`Config`.
Unknown keys and wrong types raise :class:`~functrain.errors.ConfigError` naming the key (and, for a
misspelt key, the nearest valid one). The ``model`` section is a union discriminated by ``model.name``: the
registered family's own config class (:data:`functrain.models.MODEL_FAMILIES`), or a factory
(``model.target``) whose keyword arguments are the section's other keys.
"""

import difflib
import hashlib
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from functrain.config.files import apply_overrides, read_yaml
from functrain.config.pipeline import PipelineConfig, divisors, pipeline_problem
from functrain.core.section import Section
from functrain.core.unembedding import LogitsChunk
from functrain.errors import ConfigError
from functrain.models import MODEL_FAMILIES, model_config_class
from functrain.models.configs.base import FamilyConfig, ModelConfig
from functrain.models.configs.moe import MOE_RUNTIME_KEYS, MoeOptions
from functrain.models.options import RuntimeOptions, scan_refusal

# The "split" of metrics.jsonl lines, and of metric names like "eval/loss" (harness: eval.harness_tasks' lm-eval
# scores, named "harness/<task>/<metric>").
METRIC_SPLITS = ("train", "eval", "harness")


def _split_and_name(value: str) -> str:
    if value.partition("/")[0] not in METRIC_SPLITS or not value.partition("/")[2]:
        raise ValueError("must be 'split/name' with split train, eval or harness, like 'eval/loss'")
    return value


MetricName = Annotated[str, pydantic.AfterValidator(_split_and_name)]


class RunConfig(Section):
    """``run.*``: where the run directory (config, metrics, TensorBoard, checkpoints) lives, and the persistent
    compilation cache (``compile_cache``: a directory; ``auto``: one per host under the user's cache directory;
    null: none; see :mod:`functrain.run.compile_cache`)."""

    dir: str = "runs/default"
    compile_cache: str | None = "auto"


# What the run's config records for an object passed to fit (model, data name, optimizer name).
PYTHON_OBJECT = "python_object"


def check_target(value: str | None) -> str | None:
    """An import path ``"package.module:attribute"`` (checked for form here, imported by the builder)."""
    if value is not None:
        module, sep, attribute = value.partition(":")
        if not sep or not module or not attribute:
            raise ValueError(f"{value!r} is not an import path; write it as 'package.module:factory'")
    return value


Target = Annotated[str | None, pydantic.AfterValidator(check_target)]


class MixtureSourceConfig(Section):
    """One ``data.sources`` entry: a file or store at ``path`` drawn with relative ``weight``; ``name`` is its
    loader (default: from the path, see :func:`functrain.data.datasets.open_source`)."""

    path: str
    weight: float
    name: str | None = None

    @pydantic.field_validator("weight")
    @classmethod
    def _positive(cls, value: float) -> float:
        if not value > 0:
            raise ValueError(
                f"weight {value} must be > 0 (the weights' ratios are the mixture's proportions); "
                f"give the source a positive weight or remove it"
            )
        return value


class FieldsConfig(Section):
    """``data.fields.*``: the field the model is called on (``inputs``: a name, or ``{argument: name}`` to pass
    it by keyword) and the one the built-in loss reads as labels (``labels``), for data that follows none of
    the conventions of :mod:`functrain.core.fields`; ``fit(..., inputs=, labels=)`` wins over them."""

    inputs: str | list[str] | dict[str, str] | None = None
    labels: str | None = None


class DataConfig(Section):
    """``data.*``: the dataset and its order. ``last_batch``: drop an epoch's short tail or pad it with
    weight-0 samples; ``ignore_skip`` restarts the data at sample 0 on resume (model and optimizer kept);
    ``skip_samples`` sets the position explicitly; ``prefetch`` is calls assembled ahead in a thread.
    ``target: "pkg.module:load"`` (called with ``kwargs``) replaces ``name``: it returns the training data
    (a dict of arrays, a map-style dataset, an iterable to stream) or a ``(train, eval)`` pair; a generator
    function is streamed as it is (called with the start offset on resume when it takes one).
    ``sources: [{path, weight}, ...]`` replaces ``name`` and ``path``: a mixture of those files. ``packing``
    (token stores: ``name: tokens`` or token-store entries of ``sources``) adds segment ids and positions so
    that documents never see one another. ``name: synthetic`` draws random token ids below ``model.vocab_size``
    (no corpus: :mod:`functrain.data.synthetic`). ``fields``: see :class:`FieldsConfig`. ``transform:
    "pkg.module:fn"``: ``fn(record, rng) -> record`` reshapes every record as it is read (training and
    evaluation; map-style data), so records of another shape need no data source of their own
    (``fit(..., transform=)`` wins)."""

    name: str = "char_text"
    target: Target = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    path: str | None = None
    seq_len: int = Field(128, ge=1)
    global_batch_size: int = Field(32, ge=1)
    seed: int | None = None  # None: the run's seed
    shuffle: bool = True
    last_batch: Literal["drop", "pad"] = "drop"
    ignore_skip: bool = False
    skip_samples: int | None = Field(None, ge=0)
    prefetch: int = Field(2, ge=0)
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    packing: bool = False
    sources: list[MixtureSourceConfig] | None = None
    mixture_block_size: int = Field(1024, ge=1)
    fields: FieldsConfig = Field(default_factory=FieldsConfig)
    transform: Target = None
    tokenizer: str | None = None  # name: preference: an HF tokenizer directory (None: UTF-8 bytes)

    @pydantic.model_validator(mode="after")
    def _one_kind_of_data(self) -> "DataConfig":
        if self.sources is not None:
            if not self.sources:
                raise ValueError("data.sources is empty; list at least one {path, weight} or remove the key")
            given = [key for key in ("path", "target") if getattr(self, key) is not None]
            if given:
                raise ValueError(f"data.sources replaces data.{given[0]}; keep one of them")
        elif self.packing and (self.name != "tokens" or self.target is not None):
            raise ValueError(
                "data.packing=true needs data.name=tokens (a store written by functrain tokenize); "
                "remove data.packing or set data.name=tokens"
            )
        return self


# Optimizer name -> {config key: optax argument}; weight_decay (masked to matrices) applies to all. For
# adafactor, lion and muon a key left at its config default takes optax's own default instead.
OPTIMIZER_KEYS: dict[str, dict[str, str]] = {
    "adamw": {"b1": "b1", "b2": "b2", "eps": "eps", "mu_dtype": "mu_dtype"},
    "sgd": {"momentum": "momentum", "nesterov": "nesterov", "mu_dtype": "accumulator_dtype"},
    "adafactor": {"momentum": "momentum", "eps": "eps", "mu_dtype": "dtype_momentum"},
    "lion": {"b1": "b1", "b2": "b2", "mu_dtype": "mu_dtype"},
    "muon": {
        "momentum": "beta",
        "nesterov": "nesterov",
        "eps": "eps",
        "b1": "adam_b1",
        "b2": "adam_b2",
        "mu_dtype": "mu_dtype",
    },
}
# Optimizers that take every key they read as given (the others only those set away from the defaults).
EXPLICIT_KEYS = ("adamw", "sgd")


class OptimizerConfig(Section):
    """``optimizer.*``: adamw, sgd, adafactor, lion or muon, with linear warmup then a constant, cosine or
    linear schedule. ``target: "pkg.module:make"`` (called with ``kwargs``) replaces ``name``: it returns an
    optax transformation, or a function of the schedule returning one; a target taking ``learning_rate``
    (``"optax:lion"``) gets the schedule as its learning rate."""

    name: str = "adamw"
    target: Target = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    learning_rate: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    end_lr_ratio: float = Field(0.0, ge=0)
    # dtype of the first moment / momentum (None: the parameters' dtype, or optax's default).
    mu_dtype: Literal["float32", "bfloat16"] | None = None

    def optax_options(self) -> dict[str, Any]:
        """The optax keyword arguments of ``name`` this section sets (see :data:`OPTIMIZER_KEYS`)."""
        fields = type(self).model_fields
        return {
            argument: getattr(self, key)
            for key, argument in OPTIMIZER_KEYS[self.name].items()
            if self.name in EXPLICIT_KEYS or getattr(self, key) != fields[key].default
        }

    @pydantic.model_validator(mode="after")
    def _check_keys(self) -> "OptimizerConfig":
        from functrain.core.optim import OPTIMIZER_NAMES  # imports optax; only when an optimizer is configured

        if self.target is not None or self.name == PYTHON_OBJECT:
            return self
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown optimizer.name {self.name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
        for key in ("b1", "b2", "eps", "momentum", "nesterov", "mu_dtype"):
            if key not in OPTIMIZER_KEYS[self.name] and getattr(self, key) != type(self).model_fields[key].default:
                users = [name for name, keys in OPTIMIZER_KEYS.items() if key in keys]
                raise ValueError(
                    f"optimizer.{key} is not used by optimizer.name={self.name} (only by "
                    f"{', '.join(users)}); remove it or choose one of those"
                )
        return self


class TrainConfig(Section):
    """``train.*``: run length (``max_steps`` wins over ``epochs``), the starting weights (``init_from``),
    accumulation, steps per compiled call, clipping, the non-finite policy, the precision (``compute_dtype`` for
    the forward/backward pass, ``matmul_precision`` for its products, ``param_dtype`` for the stored parameters),
    ``offload_optimizer`` (optimizer state in pinned host memory, streamed to the device for each update; GPU/TPU
    only) and (torch) ``torch.compile``."""

    max_steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    micro_batches: int = Field(1, ge=1)
    # Micro-batches of the pipeline's schedule (mesh.pipeline > 1): None, one per stage.
    pipeline_microbatches: int | None = Field(None, ge=1)
    steps_per_call: int = Field(1, ge=1)
    clip_norm: float | None = Field(None, gt=0)
    nonfinite: Literal["skip", "stop"] = "skip"
    # A finished run that skipped a larger share of its steps as non-finite exits with status 4.
    max_skipped_fraction: float = Field(0.5, ge=0.0, le=1.0)
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # The products' precision (jax.default_matmul_precision): auto is highest for float32 compute on a GPU or TPU
    # (XLA's default rounds float32 operands there: TF32, one bfloat16 pass) and XLA's default elsewhere; default
    # takes XLA's faster rounding anyway (functrain/core/precision.py).
    matmul_precision: Literal["auto", "default", "high", "highest"] = "auto"
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    loss_scale: Literal["none", "dynamic"] = "none"
    offload_optimizer: bool = False
    # backend: torch only: the module's training forward through torch.compile (minutes to compile on CPU).
    torch_compile: bool = False
    # A causal LM's loss (and preference log-probs) over chunks of positions, so the [tokens, vocab] logits never
    # exist whole: auto (when they would be large), off, or positions per chunk (functrain/core/unembedding.py).
    logits_chunk: LogitsChunk = "auto"
    # GPU: compile the step with XLA's deterministic ops, so that a resumed run is bitwise the uninterrupted one
    # (slower; XLA's attention instead of cuDNN's): functrain/parallel/determinism.py. No effect on CPU and TPU.
    deterministic: bool = True
    # A run directory (a trained run, or one `functrain convert hf-to-functrain` wrote) whose newest checkpoint's
    # weights start this run (fresh optimizer, step 0) when it has no checkpoint of its own yet; any task.
    init_from: str | None = None

    @pydantic.field_validator("logits_chunk", mode="before")
    @classmethod
    def _chunk_setting(cls, value: Any) -> Any:
        # One message for the union (pydantic would name its internal members).
        if value is False:  # YAML reads a bare `off` as false
            return "off"
        if value in ("auto", "off") or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("must be 'auto', 'off' or a number of positions per chunk (an integer >= 1)")


class CheckpointConfig(Section):
    """``checkpoint.*``: save interval, retention (latest ``keep`` plus best ``keep_best`` by
    ``best_metric``), which checkpoint to resume from, async saves and what a failed save does; local
    checkpoints (``local_dir``, every ``local_every_steps``, ``local_keep`` of them: see
    :mod:`functrain.checkpoint.local`)."""

    every_steps: int = Field(0, ge=0)  # 0: only at the end (and on SIGTERM)
    keep: int = Field(3, ge=1)
    keep_best: int = Field(0, ge=0)
    best_metric: MetricName = "eval/loss"
    best_mode: Literal["min", "max"] = "min"
    resume: Literal["auto", "never"] | Annotated[int, Field(ge=0)] = "auto"
    async_save: bool = True
    on_error: Literal["stop", "warn"] = "stop"
    local_dir: str | None = None
    local_every_steps: int = Field(0, ge=0)
    local_keep: int = Field(1, ge=1, le=2)

    @pydantic.field_validator("resume", mode="before")
    @classmethod
    def _resume_request(cls, value: Any) -> Any:
        # One message for the union (pydantic would name its internal member, 'literal[...]').
        if value in ("auto", "never") or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("must be 'auto', 'never' or a checkpoint step (an integer >= 0)")


class ParamRule(Section):
    """One ``mesh.param_rules`` entry: parameters whose path (``block_0/dense/kernel``) matches the regular
    expression ``pattern`` (``re.search``) get ``spec``, one mesh axis (or list of axes, or null) per dimension."""

    pattern: str
    spec: list[str | list[str] | None]

    @pydantic.field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"pattern {value!r} is not a regular expression ({exc})") from None
        return value


class MeshConfig(Section):
    """``mesh.*``: device mesh axes (one may be -1 for the rest; within one slice when the devices span
    several), how many slices the data, FSDP and pipeline axes span over the data-centre network (``dcn_data``,
    ``dcn_fsdp``, ``dcn_pipeline``; their product is the number of slices), logical-to-mesh axis rules, and rules by
    parameter path for parameters without logical axes (``param_rules``, first match wins; see
    :mod:`functrain.parallel.sharding` for the default rule)."""

    data: int = -1
    fsdp: int = 1
    expert: int = 1  # expert parallelism: a mixture of experts' experts split this many ways (it divides them)
    context: int = Field(1, ge=1)  # context parallelism: the sequence split this many ways (parallel/context.py)
    tensor: int = 1
    # Pipeline stages of the scanned layers (functrain/parallel/pipeline.py), in each slice.
    pipeline: int = Field(1, ge=1)
    dcn_data: int = Field(1, ge=1)
    dcn_fsdp: int = Field(1, ge=1)
    dcn_pipeline: int = Field(1, ge=1)
    rules: dict[str, str | list[str] | None] | None = None  # None: the defaults in functrain.parallel.sharding
    param_rules: list[ParamRule] = Field(default_factory=list)
    allow_replicated_fallback: bool = False

    def pipeline_stages(self) -> int:
        """The stages of the pipeline: ``pipeline`` in each slice x ``dcn_pipeline`` slices."""
        return self.pipeline * self.dcn_pipeline


class LogConfig(Section):
    """``log.*``: metric logging interval, progress bar, TensorBoard event files, experiment trackers
    (``jsonl`` is metrics.jsonl, always written; ``wandb`` and ``mlflow`` need their extras) and the PNG of
    the run's curves written at its end (``RUN_DIR/plot.png``)."""

    every_steps: int = Field(10, ge=1)
    progress: bool = True
    tensorboard: bool = True
    # RUF012 cannot see that Section is a pydantic model, which copies a mutable default for each instance.
    trackers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = ["jsonl", "tensorboard"]  # noqa: RUF012
    plot: bool = False  # the shipped char_gpt job (make train) turns it on


class SamplesConfig(Section):
    """``eval.samples.*``: ``count`` continuations of ``prompt`` written to ``RUN_DIR/samples.jsonl`` and
    TensorBoard at each evaluation of a language model (0: none); ``tokenizer``: an HF tokenizer directory
    (default: UTF-8 bytes, as ``data.name=char_text`` feeds them)."""

    count: int = Field(0, ge=0)
    prompt: str = "\n"
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.8, ge=0.0)
    top_k: int | None = Field(None, ge=1)
    tokenizer: str | None = None


class EvalConfig(Section):
    """``eval.*``: evaluation interval and size, and early stopping on a metric like ``eval/loss``."""

    every_steps: int = Field(0, ge=0)  # 0: no periodic evaluation (one at the end if there is eval data)
    max_batches: int | None = Field(None, ge=1)
    early_stopping_metric: MetricName | None = None  # e.g. "eval/loss"
    early_stopping_patience: int = Field(3, ge=1)
    early_stopping_mode: Literal["min", "max"] = "min"
    early_stopping_min_delta: float = Field(0.0, ge=0)
    samples: SamplesConfig = SamplesConfig()
    # lm-evaluation-harness tasks scored at each evaluation of a language model on the current params, logged as
    # harness/<task>/<metric> (none: off); a folder of task YAMLs (lm_eval --include_path); at most that many
    # documents per task; requests per forward pass; an HF tokenizer directory (none: UTF-8 bytes).
    harness_tasks: list[str] = Field(default_factory=list)
    harness_include_path: str | None = None
    harness_limit: int | None = Field(None, ge=1)
    harness_batch_size: int = Field(16, ge=1)
    harness_tokenizer: str | None = None


class TargetModelConfig(ModelConfig):
    """``model.target: "pkg.module:factory"``: the factory is called with the section's other keys (except
    ``kind``, the built-in loss when the data's fields do not say: ``classifier`` or ``causal_lm``) and
    returns the model (linen, NNX, ``FunctionalModel`` or, with ``backend: torch``, an ``nn.Module``).

    The keys are the factory's own: functrain reads only ``vocab_size`` and ``num_classes`` among them (an
    integer given there bounds the token ids or labels the data may hold, and ``data.name: synthetic`` draws
    ids below ``vocab_size``); the model's context, decoder shape (MFU) and layers are its own business."""

    model_config = ConfigDict(extra="allow")
    target: Annotated[str, pydantic.AfterValidator(check_target)]
    kind: Literal["classifier", "causal_lm"] | None = None

    def factory_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for the factory."""
        return dict(self.model_extra or {})

    def _integer_keyword(self, key: str) -> int | None:
        value = self.factory_kwargs().get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def vocabulary_size(self) -> int | None:
        """The factory's ``vocab_size`` keyword, when it is given as an integer."""
        return self._integer_keyword("vocab_size")

    def class_count(self) -> int | None:
        """The factory's ``num_classes`` keyword, when it is given as an integer."""
        return self._integer_keyword("num_classes")


class PythonModelConfig(Section, ModelConfig):
    """Recorded in place of a model section when ``fit`` is given a model object: its type, for the record
    (every question about the model is answered None: functrain knows nothing of it)."""

    python_object: str  # the name is PYTHON_OBJECT


# The tags of the model section's union besides the registered names.
TARGET_TAG = "target"


def model_section_tag(value: Any) -> str | None:
    """Which member of the ``model`` union ``value`` (a dict from YAML, or a validated section) belongs to:
    the family's ``name``, ``target`` or ``python_object``; None when it names none."""
    if isinstance(value, TargetModelConfig):
        return TARGET_TAG
    if isinstance(value, PythonModelConfig):
        return PYTHON_OBJECT
    if isinstance(value, ModelConfig):
        return value.registry_name()
    if isinstance(value, dict):
        if TARGET_TAG in value:
            return TARGET_TAG
        if set(value) == {PYTHON_OBJECT}:
            return PYTHON_OBJECT
        name = value.get("name")
        return name if isinstance(name, str) else None
    return None


# A member per registered family, tagged with its name, beside a factory's section and a Python object's.
_TAGGED_SECTIONS = (
    *(Annotated[cls, pydantic.Tag(name)] for name, (cls, _) in MODEL_FAMILIES.items()),
    Annotated[TargetModelConfig, pydantic.Tag(TARGET_TAG)],
    Annotated[PythonModelConfig, pydantic.Tag(PYTHON_OBJECT)],
)
if TYPE_CHECKING:  # the union is made from the registry at run time; to mypy it is the kinds of its members
    ModelSection = FamilyConfig | TargetModelConfig | PythonModelConfig
else:
    # Members known at run time only: X | Y cannot spell them (hence the noqa).
    ModelSection = Annotated[Union[_TAGGED_SECTIONS], pydantic.Discriminator(model_section_tag)]  # noqa: UP007
MODEL_TAGS = frozenset({*MODEL_FAMILIES, TARGET_TAG, PYTHON_OBJECT})


class ProfileConfig(Section):
    """``profile.*``: trace ``steps`` training steps from ``start_step`` with the JAX profiler into
    ``RUN_DIR/profile/`` (0 steps: no trace; see :mod:`functrain.run.profile`)."""

    start_step: int = Field(0, ge=0)
    steps: int = Field(0, ge=0)


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
            and not model_config_class(value["name"]).scans_layers
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
            raise ValueError(_dense_moe_key(f"mesh.expert={ways}", name, fix="set mesh.expert=1"))
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
        if self.backend == "torch":
            raise ValueError(f"mesh.context={ways} splits the sequence in backend: jax only; set mesh.context=1")
        if not self.model.context_parallel:
            name = self.model.registry_name() or "a user model (model.target or a model given to fit)"
            raise ValueError(
                f"mesh.context={ways} needs a model whose attention splits the sequence (gpt, llama and its kin: "
                f"mistral, qwen2, qwen3, phi3, and the mixtures of experts mixtral, qwen2_moe, qwen3_moe, gpt_oss, "
                f"deepseek_v3) and {name} has none; set mesh.context=1"
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
        if self.backend == "torch":
            for key, value in (
                ("param_dtype", self.train.param_dtype != "float32"),
                ("offload_optimizer", self.train.offload_optimizer),
            ):
                if value:
                    raise ValueError(f"train.{key} is for backend: jax; remove it or set backend=jax")
        if self.train.torch_compile and self.backend != "torch":
            raise ValueError(
                f"train.torch_compile=true is for backend: torch (backend is {self.backend}; the jax "
                f"step is always compiled); remove it or set backend=torch"
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
        if self.backend != "jax":
            raise ValueError("checkpoint.local_dir saves the JAX state's shards; set backend=jax or remove it")

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


def _section_class(annotation: Any) -> type[BaseModel] | None:
    """The section class a field holds, alone or optional (``model.lora``, ``model.rope_scaling``); None for
    other fields."""
    union = typing.get_origin(annotation) in (Union, types.UnionType)
    members = [
        member for member in (typing.get_args(annotation) if union else (annotation,)) if member is not type(None)
    ]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], BaseModel):
        return members[0]
    return None


def _all_keys(schema: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a schema accepts (for 'did you mean' suggestions)."""
    keys = []
    for name, field in schema.model_fields.items():
        keys.append(prefix + name)
        section = _section_class(field.annotation)
        if section is not None:
            keys.extend(_all_keys(section, prefix + name + "."))
    return keys


def _suggest(key: str, model_name: str | None) -> str:
    valid = _all_keys(config_class())
    if isinstance(model_name, str) and model_name in MODEL_FAMILIES:
        valid += _all_keys(model_config_class(model_name), "model.")
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else ""


def _dense_moe_key(key: str, model_name: Any, fix: str | None = None) -> str:
    """The refusal of a mixture-of-experts option on a model without experts (``fix``: default, remove it)."""
    moe = sorted(name for name, (config_cls, _) in MODEL_FAMILIES.items() if issubclass(config_cls, MoeOptions))
    return (
        f"{key} applies to mixture-of-experts models ({', '.join(moe)}) and model {model_name} has no experts; "
        f"{fix or f'remove {key}'}"
    )


def _format_validation_error(error: pydantic.ValidationError, raw: dict) -> str:
    """One line for the first problem: the dotted key, what is wrong and the nearest valid key."""
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"] if not str(part).startswith("function-")]
    if loc[:1] == ["model"] and len(loc) > 1 and loc[1] in MODEL_TAGS:
        del loc[1]  # the union's member (model.name), which pydantic puts in the path
    key = ".".join(loc)
    model_name = raw.get("model", {}).get("name") if isinstance(raw.get("model"), dict) else None
    if first["type"] == "extra_forbidden":
        if loc[:1] == ["model"] and loc[-1] in MOE_RUNTIME_KEYS:
            return _dense_moe_key(key, model_name)
        return f"unknown config key '{key}'{_suggest(key, model_name)}"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] in ("value_error", "assertion_error") and (not key or message.startswith(f"{key}.")):
        return f"invalid config: {message}"
    given = first.get("input")
    given_text = "" if isinstance(given, (dict, BaseModel)) else f" (got {given!r})"
    return f"config key '{key or 'model'}': {message}{given_text}"


def validate_config(raw: dict) -> Config:
    """Validate a nested dict into a :class:`Config`, or raise a one-line ConfigError."""
    try:
        return config_class().model_validate(raw)
    except pydantic.ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, raw)) from None
    except ValueError as exc:  # the model registry's unknown-name error
        raise ConfigError(str(exc)) from None


def load_config(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> Config:
    """Load ``path`` (or start from ``base``), apply ``overrides`` and validate."""
    raw = read_yaml(path) if path is not None else dict(base or {})
    return validate_config(apply_overrides(raw, list(overrides or [])))
