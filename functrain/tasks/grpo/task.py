"""The GRPO task: prompts from ``data.path``, completions sampled in-process by the experience stage, rewards on
the host, TRL's clipped policy loss on the step."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from functrain.core.adapters import ModelPieces, init_shapes
from functrain.core.program import Program
from functrain.errors import ConfigError, DataError
from functrain.models import family_names, family_of
from functrain.tasks.base import ExperienceStage, Task, TaskContext, TaskData
from functrain.tasks.chunked_logits import chunked_pieces
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.environment import EnvironmentFactory, environment_factory
from functrain.tasks.grpo.loss import LossSettings, grpo_program
from functrain.tasks.grpo.prompts import PROMPT, Prompts, PromptSource, read_prompts
from functrain.tasks.grpo.rewards import RewardFunction, reward_functions
from functrain.tasks.shared_prefix import SharedPrefix, SharedPrefixForward


def loss_settings(section: GRPOConfig) -> LossSettings:
    """The ``grpo.*`` keys the loss reads."""
    return LossSettings(
        loss_type=section.loss_type,
        importance_sampling_level=section.importance_sampling_level,
        beta=section.beta,
        epsilon=section.epsilon,
        epsilon_high=section.upper_epsilon,
        temperature=section.temperature,
        num_iterations=section.num_iterations,
        max_completion_length=section.max_completion_length,
        use_bias_correction_kl=section.use_bias_correction_kl,
        is_cap=section.async_is_cap if section.async_steps else None,
    )


class GRPO(Task):
    """Reinforcement learning from rewards: GRPO and its variants (``grpo.*``, see :mod:`functrain.tasks.grpo`)."""

    name = "grpo"

    def step_compiler_options(self, context: TaskContext) -> dict[str, str] | None:
        """On CPU, the sampler's consistent options: YNNPACK fuses dots only (its elementwise and reduction fusions
        also made XLA:CPU's backward of a Llama about twice as slow, bench/README.md: a GRPO step 118 -> 69 ms), in
        consistent arithmetic, so that the step's log-probs are the sampler's (docs/grpo.md); a batch-invariant
        model's products each alone (:func:`functrain.tasks.sampling.consistent_options`)."""
        from functrain.tasks.sampling import consistent_options, on_cpu

        return on_cpu(consistent_options(context.config.model))

    def check(self, context: TaskContext) -> None:
        """Backend jax, no user loss, a built-in causal LM (the sampler decodes it with a KV cache) and batches
        that split into whole groups of completions."""
        super().check(context)
        config, section = context.config, context.config.section(self.name)
        family = family_of(config.model)
        if family is None or not family.generation_cache:
            given = config.model.registry_name() or "a user model"
            raise ConfigError(
                f"task grpo samples completions from a built-in causal LM with a generation cache (model.name "
                f"{', '.join(family_names('generation_cache'))}), not {given}; set model.name"
            )
        generations, batch = section.num_generations, config.data.global_batch_size
        if batch % generations:
            raise ConfigError(
                f"data.global_batch_size={batch} counts completions and is not divisible by "
                f"grpo.num_generations={generations}; set it to a multiple of {generations}"
            )
        processes = jax.process_count()
        if (batch // generations) % processes:
            raise ConfigError(
                f"a step's {batch // generations} prompts (data.global_batch_size={batch} / grpo.num_generations="
                f"{generations}) do not split over the job's {processes} processes, which each sample and score "
                f"whole groups; set data.global_batch_size to a multiple of {generations * processes}"
            )
        if config.train.steps_per_call % section.num_iterations:
            raise ConfigError(
                f"train.steps_per_call={config.train.steps_per_call} is not a multiple of "
                f"grpo.num_iterations={section.num_iterations}: a call (and a checkpoint) must end where a "
                f"generation does; set train.steps_per_call to a multiple of {section.num_iterations}"
            )
        if section.async_steps and section.num_iterations > 1:
            raise ConfigError(
                f"grpo.async_steps={section.async_steps} samples ahead with one update per generation, and "
                f"grpo.num_iterations={section.num_iterations}; set grpo.num_iterations=1 or grpo.async_steps=0"
            )
        if context.data_given:
            raise ConfigError("task grpo reads its prompts from data.path; remove train_data= or use another task")
        if config.data.last_batch != "drop":
            raise ConfigError("task grpo reads whole batches of prompts; remove data.last_batch (drop)")

    def prompts(self, context: TaskContext) -> Prompts:
        """The prompts of ``data.path``, tokenised with ``data.tokenizer`` (UTF-8 bytes when unset)."""
        from functrain.tasks.preference.pairs import load_preference_tokenizer

        data = context.config.data
        if not data.path:
            raise ConfigError(
                'task grpo needs prompts; set data.path=PROMPTS.jsonl (a "prompt" per line, other keys are '
                "columns the reward functions read)"
            )
        tokenizer = load_preference_tokenizer(data.tokenizer) if data.tokenizer else None
        return read_prompts(data.path, tokenizer)

    def rewards(self, context: TaskContext, prompts: Prompts) -> list[RewardFunction]:
        """The reward functions of ``grpo.reward_funcs``, checked against the prompts' columns (and the
        ``environments`` keyword with an environment)."""
        section = context.config.section(self.name)
        columns = {name for row in prompts.rows for name in row if name != PROMPT}
        environment = section.environment_factory is not None
        return reward_functions(section.reward_funcs, section.format_pattern, columns, environment)

    def environment(self, context: TaskContext) -> EnvironmentFactory | None:
        """The factory of ``grpo.environment_factory`` (None: single-turn completions), checked."""
        entry = context.config.section(self.name).environment_factory
        return None if entry is None else environment_factory(entry)

    def host_metric_names(self, context: TaskContext, prompts: Prompts) -> tuple[str, ...]:
        """The metrics the experience stage computes on the host (:func:`.rollout.host_metric_names`)."""
        from functrain.tasks.grpo.rollout import host_metric_names, reward_names

        environment, section = self.environment(context), context.config.section(self.name)
        names = reward_names(self.rewards(context, prompts), environment)
        return host_metric_names(names, environment is not None, section.async_steps > 0)

    def data(self, context: TaskContext) -> TaskData:
        """The prompts' indices as the loader's records (a step reads ``global_batch_size / num_generations``);
        the step is built for the training batch the experience stage makes of them."""
        from functrain.tasks.grpo.rollout import example_batch

        config, section = context.config, context.config.section(self.name)
        prompts = self.prompts(context)
        metrics = len(self.host_metric_names(context, prompts))  # checks the reward functions and the environment
        self.check_positions(config, section, prompts)
        per_step = config.data.global_batch_size // section.num_generations
        if len(prompts.rows) < per_step:
            raise DataError(
                f"{prompts.path} holds {len(prompts.rows)} prompts and a step reads {per_step} "
                f"(data.global_batch_size / grpo.num_generations); add prompts or lower data.global_batch_size"
            )
        return TaskData(
            train=PromptSource(prompts),
            eval=None,
            example_fields=lambda _: example_batch(prompts, section, config.data.global_batch_size, metrics),
            records_per_step=per_step,
        )

    @staticmethod
    def check_positions(config: Any, section: GRPOConfig, prompts: Prompts) -> None:
        """The longest prompt and its completion, but the last token (never fed back), must fit in the model's
        positions; with an environment, a whole turn after the longest context a turn starts from (the longest
        prompt and ``max_completion_length - 1`` tokens: the sampler runs every turn at that shape)."""
        limit = config.model.max_positions()
        needed = prompts.longest + section.max_completion_length - 1
        if limit is not None and needed > limit:
            raise ConfigError(
                f"the longest prompt of {prompts.path} ({prompts.longest} tokens) and "
                f"grpo.max_completion_length={section.max_completion_length} tokens need {needed} positions (the "
                f"last token is never fed back) and the model has {limit}; lower grpo.max_completion_length, "
                f"shorten the prompts or use a longer context"
            )
        needed += section.turn_length - 1
        if section.environment_factory is not None and limit is not None and needed > limit:
            raise ConfigError(
                f"a turn of grpo.max_turn_length={section.turn_length} tokens after the longest prompt of "
                f"{prompts.path} ({prompts.longest} tokens) and grpo.max_completion_length="
                f"{section.max_completion_length} - 1 tokens of its episode needs {needed} positions and the model "
                f"has {limit}; lower grpo.max_turn_length or grpo.max_completion_length, or use a longer context"
            )

    def model_inputs(self, context: TaskContext, data: TaskData, example_batch: dict[str, np.ndarray]) -> Any:
        """A causal LM called on the rows' tokens but the last."""
        return np.asarray(example_batch["tokens"])[:, :-1]

    def program(
        self, context: TaskContext, data: TaskData, pieces: ModelPieces, example_batch: dict[str, np.ndarray]
    ) -> Program:
        """TRL's GRPO loss on the model's pieces (its log-probs over chunks of positions where the logits would be
        large, ``train.logits_chunk``), with the host metrics the stage computes."""
        section = context.config.section(self.name)
        metrics = self.host_metric_names(context, prompts_of(data))
        chunked = chunked_pieces(pieces, context.config.train.logits_chunk)
        shared = shared_prefix_forward(context.config, section, pieces, prompts_of(data), example_batch)
        return grpo_program(chunked, loss_settings(section), metrics, shared)

    def experience(self, context: TaskContext, data: TaskData, pieces: ModelPieces) -> ExperienceStage:
        """The rollouts: G completions per prompt with the current weights, scored on the host."""
        from functrain.tasks.grpo.paging import paging_of
        from functrain.tasks.grpo.rollout import SAMPLES_FILE, Rollouts
        from functrain.tasks.sampling import Sampler

        config, section = context.config, context.config.section(self.name)
        prompts = prompts_of(data)
        environment = self.environment(context)
        sampler = Sampler(
            config.model,
            chunked_pieces(pieces, config.train.logits_chunk),  # its forward scores as the step's
            config.train.compute_dtype,
            max_new_tokens=section.max_completion_length if environment is None else section.turn_length,
            temperature=section.temperature,
            top_k=section.top_k or None,  # TRL: 0 keeps every token
            top_p=section.top_p if section.top_p < 1.0 else None,
            precision=config.train.matmul_precision,
            deterministic=config.train.deterministic,
            paging=paging_of(section, prompts, environment is not None),
        )
        every = config.log.every_steps
        samples = (context.run_dir / SAMPLES_FILE, every) if every else None
        rewards, rows = self.rewards(context, prompts), config.data.global_batch_size
        return Rollouts(sampler, prompts, rewards, section, samples, environment, batch_rows=rows)


def shared_prefix_forward(
    config: Any, section: GRPOConfig, pieces: ModelPieces, prompts: Prompts, example_batch: dict[str, np.ndarray]
) -> SharedPrefixForward | None:
    """The forward that runs each group's first ``prompts.shortest`` tokens once (``grpo.share_prompt``), where the
    step's forward is the plain model's: no transform (LoRA), no pipeline or context split, no remat (the sampling
    model has none), no dropout, no model state or loss terms (a mixture of experts' router statistics count
    tokens); and where each micro-batch holds whole runs of a group's rows (``train.micro_batches`` takes every
    M-th row, so it divides ``num_generations``). Else None: the plain forward."""
    import jax

    from functrain.core.precision import COMPUTE_DTYPES

    micro_batches, generations = config.train.micro_batches, section.num_generations
    model = config.model
    plain = (
        pieces.trainable is not None
        or pieces.frozen_apply is not None
        or config.mesh.pipeline_stages() > 1
        or config.mesh.context > 1
        or model.remat != "none"
        or getattr(model, "dropout", 0.0) > 0
    )
    # A shortest prompt of one token leaves nothing to share: every row runs a prefix's last token itself.
    whole_runs = generations % micro_batches == 0 and generations // micro_batches >= 2
    if not section.share_prompt or plain or not whole_runs or prompts.shortest < 2:
        return None
    params, model_state = init_shapes(pieces.init)
    inputs = np.asarray(example_batch["tokens"])[:, :-1]
    output = jax.eval_shape(lambda p: pieces.apply(p, model_state, inputs, True, jax.random.PRNGKey(0)), params)
    if jax.tree.leaves(model_state) or output.terms is not None:
        return None
    prefix = SharedPrefix(rows=generations // micro_batches, length=prompts.shortest)
    return SharedPrefixForward(model, COMPUTE_DTYPES[config.train.compute_dtype], prefix, config.train.logits_chunk)


def prompts_of(data: TaskData) -> Prompts:
    """The prompts :meth:`GRPO.data` read (its training source holds them)."""
    assert isinstance(data.train, PromptSource), "GRPO.data made the training source"
    return data.train.prompts


TASKS = {"grpo": GRPO()}
