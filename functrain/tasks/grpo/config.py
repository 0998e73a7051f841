"""``grpo.*``: the section of a ``task: grpo`` run, named as TRL 1.16's ``GRPOConfig`` names things (pydantic only,
so reading a config stays cheap)."""

from typing import Any, Literal

import pydantic
from pydantic import Field

from functrain.core.section import TaskSection

# The reward functions functrain ships (``grpo.reward_funcs`` entries without a ``module:function`` path).
BUILTIN_REWARDS = ("accuracy", "format")


class GRPOConfig(TaskSection):
    """``grpo.*``: reinforcement learning from rewards (GRPO, DAPO, Dr. GRPO, GSPO), TRL's names and defaults.

    Sampling: ``num_generations`` completions per prompt (G), each at most ``max_completion_length`` tokens, drawn
    at ``temperature`` from the ``top_k`` most likely tokens (0: all) and the smallest set holding ``top_p`` of the
    probability. Rewards: ``reward_funcs`` (``module:function`` names with TRL's signature, or the built-in
    ``accuracy`` and ``format``; ``format_pattern`` is the built-in ``format``'s regex), combined with
    ``reward_weights`` (None: 1 each). Advantages: reward minus its group's mean, divided by the group's standard
    deviation (``scale_rewards: group``), the batch's (``batch``) or nothing (``none``). Loss: the clipped
    ratio ``[1 - epsilon, 1 + epsilon_high]`` per token or per sequence (``importance_sampling_level``, GSPO:
    ``sequence``), plus ``beta`` times the k3 KL to the reference (0: no reference kept; multiplied by the ratio with
    ``use_bias_correction_kl``, TRL 1.16's default: the unbiased reverse-KL gradient), reduced as
    ``loss_type`` says (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``); ``num_iterations`` updates per generation;
    ``mask_truncated_completions`` drops completions that reached ``max_completion_length`` without an EOS.
    Episodes (functrain's): ``environment_factory`` (``module:Class`` or ``file.py:Class``, TRL's name) makes one
    environment per completion, whose ``reset`` and ``step`` answer the model's turns
    (:mod:`functrain.tasks.grpo.episodes`) for at most ``max_turns`` turns of at most ``max_turn_length`` tokens
    each (None: ``max_completion_length``), within ``max_completion_length`` tokens of model and environment
    together (both keys are read only with an environment). Asynchronous GRPO (functrain's): ``async_steps`` (k)
    samples the batches of the next k steps while a step trains (0: synchronous), their token losses weighted by the
    importance-sampling ratio of the trained policy to the sampling one, truncated at ``async_is_cap``
    (:mod:`functrain.tasks.grpo.ahead`). Sampler (functrain's): ``sampler: paged`` decodes in pages of ``page_size``
    positions with ``decode_slots`` rows at once (:mod:`functrain.text.paged_decode`)."""

    num_generations: int = Field(8, ge=2)
    max_completion_length: int = Field(512, ge=1)
    temperature: float = Field(1.0, gt=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    beta: float = Field(0.0, ge=0.0)
    epsilon: float = Field(0.2, gt=0.0, lt=1.0)
    epsilon_high: float | None = Field(None, gt=0.0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    num_iterations: int = Field(1, ge=1)
    use_bias_correction_kl: bool = True
    mask_truncated_completions: bool = False
    reward_funcs: list[str] = Field(default_factory=list)
    reward_weights: list[float] | None = None
    format_pattern: str = r"^<think>.*?</think>\s*<answer>.*?</answer>$"
    share_prompt: bool = True  # functrain's: a group's prompt prefix runs once in the step (tasks/shared_prefix.py)
    sampler: Literal["dense", "paged"] = "dense"  # functrain's: paged, continuous batching (docs/grpo.md)
    page_size: int | None = Field(None, ge=1)  # the paged sampler's positions a page (None: <= 16, dividing its cache)
    decode_slots: int | None = Field(None, ge=1)  # the paged sampler's rows decoded at once (None: all)
    environment_factory: str | None = None
    max_turns: int = Field(8, ge=1)
    max_turn_length: int | None = Field(None, ge=1)
    async_steps: int = Field(0, ge=0)
    async_is_cap: float = Field(3.0, gt=0.0)  # TRL's vllm_importance_sampling_cap

    @pydantic.field_validator("scale_rewards", mode="before")
    @classmethod
    def _boolean_scale_rewards(cls, value: Any) -> Any:
        """TRL's older booleans: true is ``group``, false is ``none``."""
        return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @pydantic.model_validator(mode="after")
    def _weights_match(self) -> "GRPOConfig":
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward "
                f"functions; give one weight per entry of grpo.reward_funcs"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _turns_fit_an_episode(self) -> "GRPOConfig":
        if (self.max_turn_length or 0) > self.max_completion_length:
            raise ValueError(
                f"grpo.max_turn_length={self.max_turn_length} exceeds grpo.max_completion_length="
                f"{self.max_completion_length}, the tokens of a whole episode; lower it"
            )
        return self

    @property
    def turn_length(self) -> int:
        """The most tokens of one turn of the model: ``max_turn_length``, or ``max_completion_length``."""
        return self.max_turn_length or self.max_completion_length

    @property
    def upper_epsilon(self) -> float:
        """``epsilon_high``, or ``epsilon`` when it is not set (TRL's rule)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def implied_by(cls, config: Any) -> bool:
        """``data.name: prompts`` (a JSONL of prompts at ``data.path``) trains with rewards."""
        data = config.data
        return data.name == "prompts" and data.target is None and data.sources is None
