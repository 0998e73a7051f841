"""Multi-turn episodes: the model's turns and an environment's answers (:mod:`functrain.tasks.grpo.environment`),
sampled turn by turn with the step's weights.

An episode is what follows its prompt: the environment's opening text (``reset``), then turns of the model (up to
its EOS, included, or ``grpo.max_turn_length`` tokens), each followed by the environment's answer (``step``), until
the environment says it is over, the model has had ``grpo.max_turns`` turns, or the episode holds
``grpo.max_completion_length`` tokens (model and environment together; the text that does not fit is cut). An
episode that the environment did not end is truncated (``completions/clipped_ratio``; left out of the loss with
``mask_truncated_completions``).

Each turn samples every row of this process in one call of the run's compiled sampler, the row's prompt and
episode so far as its prompt: the environment's tokens are fed as the prompt's are, the model's are drawn with
their log-probs. So the training forward scores each model token after the same tokens the sampler saw, and the
environment's tokens carry no sampler log-prob (left out of ``rollout/logprob_gap``) and a completion mask of 0
(out of the loss, its metrics and the token counts). The key of turn ``t`` is ``fold_in(key, t)``. Every process
runs a turn while any process has an open episode (the sampler is one program over all of them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from functrain.parallel.distributed import any_process
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.environment import EnvironmentFactory, answer, reset
from functrain.tasks.grpo.prompts import Prompts
from functrain.tasks.sampling import Sampler


@dataclass
class Episode:
    """One row's episode as it grows: its tokens, which the model drew, their sampler log-probs (NaN on the
    environment's), its summed reward, its turns, and whether the environment ended it or it is still open."""

    tokens: list[int] = field(default_factory=list)
    from_model: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    ended: bool = False
    open: bool = True

    def add(self, ids: np.ndarray, budget: int, logps: np.ndarray | None = None) -> None:
        """Append ``ids`` (the model's with their ``logps``, else the environment's), cut at ``budget`` tokens."""
        ids = ids[: budget - len(self.tokens)]
        self.tokens += ids.tolist()
        self.from_model += [int(logps is not None)] * len(ids)
        self.logps += [np.nan] * len(ids) if logps is None else logps[: len(ids)].tolist()


@dataclass(frozen=True)
class Episodes:
    """What a generation's episodes drew for ``R`` rows (each prompt ``num_generations`` times, consecutively): the
    rows' prompt indices, each episode's tokens, 1 where the model drew them, the sampler's log-probs (NaN on the
    environment's tokens), whether the environment ended it, its reward (the sum of its steps') and turns."""

    prompt_index: np.ndarray
    ids: list[np.ndarray]
    from_model: list[np.ndarray]
    sampler_logps: list[np.ndarray]
    ended: np.ndarray
    rewards: np.ndarray
    turns: np.ndarray


def play(
    sampler: Sampler,
    params: Any,
    prompts: Prompts,
    indices: np.ndarray,
    key: jax.Array,
    section: GRPOConfig,
    factory: EnvironmentFactory,
    environments: list[Any],
    step: int,
) -> Episodes:
    """The episodes of ``num_generations`` rows for each prompt of ``indices``, one environment each, at the step
    of index ``step`` (named in an environment's errors)."""
    rows = np.repeat(indices, section.num_generations)
    budget = section.max_completion_length
    episodes = [Episode() for _ in rows]
    for index, environment, episode in zip(rows, environments, episodes):
        opening = reset(environment, factory.name, prompts.rows[index], _named(prompts, index), step)
        episode.add(prompts.encode(opening), budget)
        episode.open = len(episode.tokens) < budget
    turn = 0
    while any_process([any(episode.open for episode in episodes)])[0]:
        turn += 1
        drawn, drawn_logps = _turn(sampler, params, prompts, rows, episodes, jax.random.fold_in(key, turn), section)
        for row, (index, environment, episode) in enumerate(zip(rows, environments, episodes)):
            if not episode.open:
                continue
            ids, logps = drawn[row], drawn_logps[row]
            ends = np.isin(ids, prompts.eos_ids)
            stop = int(ends.argmax()) + 1 if ends.any() else len(ids)  # through the turn's EOS
            episode.add(ids[:stop], budget, logps[:stop])
            episode.turns = turn
            completion = prompts.texts([ids[:stop]])[0]
            text, reward, done = answer(environment, factory.name, completion, _named(prompts, index), turn, step)
            episode.reward += reward
            if done:
                episode.ended, episode.open = True, False
            elif turn < section.max_turns and len(episode.tokens) < budget:
                episode.add(prompts.encode(text), budget)
                episode.open = len(episode.tokens) < budget
            else:
                episode.open = False
    return Episodes(
        prompt_index=rows,
        ids=[np.asarray(episode.tokens, np.int32) for episode in episodes],
        from_model=[np.asarray(episode.from_model, np.int32) for episode in episodes],
        sampler_logps=[np.asarray(episode.logps, np.float32) for episode in episodes],
        ended=np.array([episode.ended for episode in episodes]),
        rewards=np.array([episode.reward for episode in episodes], np.float32),
        turns=np.array([episode.turns for episode in episodes], np.int32),
    )


def _turn(
    sampler: Sampler,
    params: Any,
    prompts: Prompts,
    rows: np.ndarray,
    episodes: list[Episode],
    key: jax.Array,
    section: GRPOConfig,
) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens, log-probs)`` ``[R, turn_length]`` the sampler draws after each row's prompt and episode so far (a
    closed episode's row runs its prompt alone, its draws unused). One shape for every turn: a row's context is at
    most the longest prompt and ``max_completion_length - 1`` tokens (an open episode has room for one more)."""
    width = prompts.longest + section.max_completion_length - 1
    padded = np.full((len(rows), width), prompts.pad_id, np.int32)
    lengths = np.empty(len(rows), np.int32)
    for row, (index, episode) in enumerate(zip(rows, episodes)):
        context = np.concatenate([prompts.ids[index], episode.tokens if episode.open else []]).astype(np.int32)
        padded[row, : len(context)], lengths[row] = context, len(context)
    prefill = prompts.shortest
    tokens, logps = sampler.sample(params, padded, lengths, key, prefill=prefill)
    drawn_at = (lengths - prefill)[:, None] + np.arange(section.turn_length)
    return np.take_along_axis(tokens, drawn_at, 1), np.take_along_axis(logps, drawn_at, 1)


def _named(prompts: Prompts, index: int) -> str:
    """Prompt ``index`` as an error names it."""
    return f"prompt {index} of {prompts.path} (counted from 0)"
