"""The config's sections: ``run``, ``data``, ``optimizer``, ``train``, ``checkpoint``, ``mesh``, ``log``, ``eval``
and ``profile``, each a typed :class:`~functrain.core.section.Section` whose own checks need no other section
(the whole config's cross-checks are :class:`functrain.config.schema.RunSections`')."""

import re
from typing import Annotated, Any, Literal

import pydantic
from pydantic import Field

from functrain.core.section import Section
from functrain.core.unembedding import LogitsChunk

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
    the forward/backward pass, ``matmul_precision`` for its products, ``param_dtype`` for the stored parameters,
    ``fp8`` for FP8 projections),
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
    # The built-in models' attention and MLP projections as FP8 products (E4M3 operands, E5M2 gradients, current
    # per-tensor scaling); the LM head, the MoE router and experts stay in compute_dtype (functrain/core/fp8.py).
    fp8: bool = False
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


class ProfileConfig(Section):
    """``profile.*``: trace ``steps`` training steps from ``start_step`` with the JAX profiler into
    ``RUN_DIR/profile/`` (0 steps: no trace; see :mod:`functrain.run.profile`)."""

    start_step: int = Field(0, ge=0)
    steps: int = Field(0, ge=0)
