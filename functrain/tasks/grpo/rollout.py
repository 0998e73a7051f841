"""GRPO's experience stage: the loader's prompts -> G completions each, sampled with the current weights, scored on
the host, as a training batch (:mod:`functrain.tasks.grpo.loss` describes its fields).

Sampling runs in-process on the model being trained (:class:`functrain.tasks.sampling.Sampler`: the KV-cache
decoder on the step's own weights), compiled once for the run's shapes (every batch holds ``global_batch_size``
rows of the file's longest prompt plus ``max_completion_length``). The key of step ``s`` derives from
(seed, ``s``): a batch is a pure function of (weights, data position, step), and a resumed run draws what an
uninterrupted one drew.

At every ``log.every_steps``-th step the stage appends the first prompt's completions, their rewards and advantages
to ``RUN_DIR/samples.jsonl`` (``{"step", "index", "prompt", "text", "reward", "rewards", "advantage"}``; the run's
summary prints the first).

The batch carries the sampler's log-probs of the drawn tokens (``sampler_logps``); the train step compares them
with its own forward's (``rollout/logprob_gap``, :mod:`functrain.tasks.grpo.loss`), so no second forward scores
the tokens at ``num_iterations: 1``. With ``num_iterations`` above 1 a training forward scores them once at the
generation: the old policy's log-probs; the batch generated at a step whose index is a multiple of
``num_iterations`` is trained on for that many steps (the loader's prompts of the steps in between are not used),
and a run that resumes inside a generation samples anew.

``num_tokens`` (TRL's): the prompt and completion tokens of every generation since the run began, the whole batch's
(each row's prompt counted, as TRL counts them), a Python int on the host, logged as it is (:meth:`Rollouts.logged`).
It is history, not a function of the step: a checkpoint's meta records it with the step's train metrics and a
resumed run continues from there (:meth:`Rollouts.resume`), so the resumed run logs what an uninterrupted one does.

With ``grpo.async_steps`` the stage also makes the batches of the next steps while a step trains
(:meth:`Rollouts.make_ahead`, :mod:`functrain.tasks.grpo.ahead`); a batch's tokens count once it trains.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from functrain.checkpoint.meta import metric_value
from functrain.data.global_array import to_local
from functrain.parallel.distributed import all_rows
from functrain.tasks.grpo.advantages import group_advantages, reward_metrics
from functrain.tasks.grpo.ahead import TOKENS, InFlight
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.environment import EnvironmentFactory, make_environments
from functrain.tasks.grpo.episodes import play
from functrain.tasks.grpo.prompts import Prompts
from functrain.tasks.grpo.rewards import ENVIRONMENTS, RewardFunction, scores
from functrain.tasks.sampling import Sampler


def reward_names(functions: list[RewardFunction], environment: EnvironmentFactory | None) -> list[str]:
    """The names of the rewards' columns: the environment's first (its factory's name, TRL's), then the
    functions'."""
    return ([environment.name] if environment else []) + [f.name for f in functions]


def host_metric_names(rewards: list[str], episodes: bool = False, asynchronous: bool = False) -> tuple[str, ...]:
    """The metrics the stage computes on the host, in the order of the batch's ``host_metrics`` columns: of the
    ``rewards`` (:func:`reward_names`), the completions, with an environment the ``episodes``' turns, and when it
    samples ahead (``asynchronous``) the age of the weights that sampled the batch, in steps."""
    per_function = [f"rewards/{name}/{stat}" for name in rewards for stat in ("mean", "std")]
    return (
        "reward",
        "reward_std",
        *per_function,
        "frac_reward_zero_std",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
        *(("turns/mean", "turns/min", "turns/max") if episodes else ()),
        *(("rollout/staleness",) if asynchronous else ()),
    )


@dataclass(frozen=True)
class Completions:
    """What a generation drew for ``R`` rows (each prompt ``num_generations`` times, consecutively): the rows'
    prompt indices, the completions' token ids (EOS included, nothing after it), which ended without an EOS (an
    episode: that its environment did not end), the sampler's log-prob of each completion token (NaN on an
    environment's), and an episode's 1 where the model drew the token (None: everywhere)."""

    prompt_index: np.ndarray
    ids: list[np.ndarray]
    truncated: np.ndarray
    sampler_logps: list[np.ndarray]
    from_model: list[np.ndarray] | None = None


def draw(
    sampler: Sampler, params: Any, prompts: Prompts, indices: np.ndarray, key: jax.Array, generations: int, length: int
) -> Completions:
    """``generations`` completions of at most ``length`` tokens for each prompt of ``indices``."""
    rows = np.repeat(indices, generations)
    width = prompts.longest
    padded = np.full((len(rows), width), prompts.pad_id, np.int32)
    lengths = np.array([len(prompts.ids[index]) for index in rows], np.int32)
    for row, index in enumerate(rows):
        padded[row, : lengths[row]] = prompts.ids[index]
    prefill = prompts.shortest
    tokens, logps = sampler.sample(params, padded, lengths, key, prefill=prefill, repeats=generations)
    drawn_at = (lengths - prefill)[:, None] + np.arange(length)  # each row's drawn tokens, after its own prompt
    drawn, drawn_logps = np.take_along_axis(tokens, drawn_at, 1), np.take_along_axis(logps, drawn_at, 1)
    ends = np.isin(drawn, prompts.eos_ids)
    stops = np.where(ends.any(1), ends.argmax(1) + 1, length)  # through the first EOS
    last = drawn[np.arange(len(rows)), stops - 1]
    truncated = ~np.isin(last, (*prompts.eos_ids, prompts.pad_id))
    ids = [row[:stop] for row, stop in zip(drawn, stops)]
    sampler_logps = [row[:stop] for row, stop in zip(drawn_logps, stops)]
    return Completions(rows, ids, truncated, sampler_logps)


def training_rows(prompts: Prompts, completions: Completions, length: int) -> tuple[np.ndarray, ...]:
    """``(tokens, completion_mask, sampler_logps)``: ``[R, longest prompt + length]`` each row its prompt, its
    completion and padding, 1 on the completion's tokens the model drew; ``[R, longest prompt + length - 1]`` the
    sampler's log-prob of each drawn token where the position before it is (a training forward's layout: position
    ``t`` scores token ``t + 1``), NaN elsewhere."""
    width = prompts.longest + length
    tokens = np.full((len(completions.ids), width), prompts.pad_id, np.int32)
    mask = np.zeros((len(completions.ids), width), np.int32)
    sampler_logps = np.full((len(completions.ids), width - 1), np.nan, np.float32)
    for row, (index, ids, logps) in enumerate(
        zip(completions.prompt_index, completions.ids, completions.sampler_logps)
    ):
        prompt = prompts.ids[index]
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt) : len(prompt) + len(ids)] = ids
        drawn = 1 if completions.from_model is None else completions.from_model[row]
        mask[row, len(prompt) : len(prompt) + len(ids)] = drawn
        sampler_logps[row, len(prompt) - 1 : len(prompt) - 1 + len(ids)] = logps
    return tokens, mask, sampler_logps


SAMPLES_FILE = "samples.jsonl"  # functrain.report.samples.SAMPLES_FILE: the run's summary prints its newest


def sample_records(
    step: int,
    prompts: Prompts,
    completions: Completions,
    texts: list[Any],
    table: np.ndarray,
    names: list[str],
    weights: np.ndarray,
    advantages: np.ndarray,
    rows: int,
) -> list[dict[str, Any]]:
    """The first ``rows`` completions of a generation as ``samples.jsonl`` records."""
    records = []
    for row in range(rows):
        text = texts[row][-1]["content"] if isinstance(texts[row], list) else texts[row]
        scored = {name: None if np.isnan(value) else float(value) for name, value in zip(names, table[row])}
        reward = None if np.isnan(table[row]).all() else float(np.nansum(table[row] * weights))
        prompt = prompts.text(int(completions.prompt_index[row]))
        records.append(
            {
                "step": step,
                "index": row,
                "prompt": prompt,
                "text": text,
                "reward": reward,
                "rewards": scored,
                "advantage": float(advantages[row]),
            }
        )
    return records


class Rollouts:
    """The experience stage (:class:`functrain.tasks.base.ExperienceStage`) of a GRPO run; ``samples``: the file
    to append samples to and every how many steps (None: none written); ``environment``: the factory of the
    environments that multi-turn episodes talk to (None: one completion per row). With ``grpo.async_steps`` (k) it
    samples ahead: :attr:`ahead` is k and the backend calls :meth:`take` and :meth:`make_ahead` around each step;
    ``batch_rows``: the whole batch's rows (the shapes of the batches made ahead in a checkpoint)."""

    across_processes = True  # each process samples and scores its prompts; the batch's statistics gathered

    def __init__(
        self,
        sampler: Sampler,
        prompts: Prompts,
        rewards: list[RewardFunction],
        section: GRPOConfig,
        samples: tuple[Path, int] | None = None,
        environment: EnvironmentFactory | None = None,
        batch_rows: int = 0,
    ) -> None:
        self.sampler, self.prompts, self.rewards, self.section = sampler, prompts, rewards, section
        self.batch_rows = batch_rows  # the whole batch's, over every process (a checkpointed batch's shapes)
        self.samples, self.environment = samples, environment
        weights = [1.0] * bool(environment) + list(section.reward_weights or [1.0] * len(rewards))
        self.weights = np.asarray(weights, np.float32)  # the environment's reward weighs 1 (TRL's)
        self.reward_names = reward_names(rewards, environment)
        self.ahead = section.async_steps
        self.metric_names = host_metric_names(self.reward_names, environment is not None, self.ahead > 0)
        self._generation: tuple[int, dict[str, np.ndarray]] | None = None  # (generation index, its batch)
        self._environments: list[Any] | None = None  # one per row of this process, made at the first generation
        self.num_tokens = 0  # prompt and completion tokens of the generations trained on so far (TRL's num_tokens)
        self.made_tokens = 0  # ... of the generation just made
        self.in_flight = InFlight(self.ahead)

    def __call__(self, params: Any, batch: dict[str, Any], key: jax.Array, step: int) -> dict[str, np.ndarray]:
        generation = step // self.section.num_iterations
        if self._generation is None or self._generation[0] != generation:
            made = self.generate(params, np.asarray(batch["prompt_index"]), key, step)
            self._generation, self.num_tokens = (generation, made), self.num_tokens + self.made_tokens
        return self._generation[1]

    def take(self, step: int) -> dict[str, np.ndarray] | None:
        """The batch made ahead for the step of index ``step``, its tokens counted (None: none was made, the
        pipeline starts: the backend samples it with :meth:`__call__`)."""
        taken = self.in_flight.take(step)
        if taken is None:
            return None
        self.num_tokens += taken[1]
        return taken[0]

    def make_ahead(self, params: Any, batch: dict[str, Any], key_of: Callable[[int], jax.Array], step: int) -> None:
        """Sample with ``params`` (the weights of the step of index ``step``) from the loader's prompts of that step
        the batches of the steps up to ``step + k`` not made yet, each with its own step's key (``key_of(step)``)."""
        indices = np.asarray(batch["prompt_index"])
        for target in self.in_flight.missing(step):
            made = self.generate(params, indices, key_of(target), target, made_at=step)
            self.in_flight.put(target, made, self.made_tokens)

    def saved_ahead(self) -> list[dict[str, np.ndarray]]:
        """The batches made ahead, as the checkpoint holds them (:meth:`.ahead.InFlight.saved`)."""
        return self.in_flight.saved()

    def ahead_example(self) -> dict[str, np.ndarray]:
        """A batch made ahead as the checkpoint holds it, of the whole batch's rows (zeros: its shapes)."""
        example = example_batch(self.prompts, self.section, self.batch_rows, len(self.metric_names))
        return {**example, TOKENS: np.zeros(self.batch_rows, np.int32)}

    def restore_ahead(self, step: int, saved: list[dict[str, np.ndarray]]) -> None:
        """Hold the batches made ahead that a checkpoint of step ``step`` holds (:meth:`.ahead.InFlight.restore`)."""
        self.in_flight.restore(step, saved)

    def logged(self, step: int) -> dict[str, float]:
        """Logged as it is beside step ``step``'s metrics: the running token count through its generation."""
        return {"num_tokens": float(self.num_tokens)}

    def resume(self, meta: dict[str, Any]) -> None:
        """Continue the token count from the restored checkpoint's (0 when it recorded none: written before
        functrain logged it, or by a save before any step ran)."""
        self.num_tokens = int(metric_value(meta, "train/num_tokens") or 0)

    def completions_of(
        self, params: Any, indices: np.ndarray, key: jax.Array, step: int
    ) -> tuple[Completions, dict[str, list[Any]], np.ndarray | None]:
        """``(completions, reward keywords, the episodes' [rewards, turns] or None)`` of this process's prompts
        ``indices``: one completion each (:func:`draw`), or with an environment an episode each
        (:func:`functrain.tasks.grpo.episodes.play`); the reward functions' keywords are the rows' columns, and
        with an environment ``environments``."""
        section, prompts = self.section, self.prompts
        if self.environment is None:
            completions = draw(
                self.sampler, params, prompts, indices, key, section.num_generations, section.max_completion_length
            )
            return completions, prompts.columns(completions.prompt_index), None
        if self._environments is None:
            self._environments = make_environments(self.environment, len(indices) * section.num_generations, step)
        environments = self._environments
        episodes = play(self.sampler, params, prompts, indices, key, section, self.environment, environments, step)
        completions = Completions(
            episodes.prompt_index, episodes.ids, ~episodes.ended, episodes.sampler_logps, episodes.from_model
        )
        keywords = {**prompts.columns(completions.prompt_index), ENVIRONMENTS: environments}
        return completions, keywords, np.column_stack([episodes.rewards, episodes.turns]).astype(np.float32)

    def generate(
        self, params: Any, indices: np.ndarray, key: jax.Array, step: int, made_at: int | None = None
    ) -> dict[str, np.ndarray]:
        """The training batch of the step of index ``step`` of this process's prompts ``indices`` (the loader's
        slice): sampled (every process its own rows, on the devices that train them), scored on this process, laid
        out for the loss; advantages, normalisers and metrics from the whole batch's rewards and lengths; its tokens
        in ``made_tokens``. ``made_at``: the step whose weights ``params`` are (None: ``step``'s)."""
        section, prompts = self.section, self.prompts
        length = section.max_completion_length
        completions, keywords, episodes = self.completions_of(params, indices, key, step)
        tokens, mask, sampler_logps = training_rows(prompts, completions, length)
        # The old policy's log-probs, dispatched: the forward runs while the host decodes and scores.
        old_logps = self.sampler.forward(params, tokens) if section.num_iterations > 1 else None
        texts = prompts.decode(completions.ids)
        table = scores(
            self.rewards,
            [prompts.rows[index]["prompt"] for index in completions.prompt_index],
            texts,
            [ids.tolist() for ids in completions.ids],
            keywords,
            step,
        )
        if episodes is not None:  # the environment's reward comes first
            table = np.column_stack([episodes[:, 0], table]).astype(np.float32)
        if section.mask_truncated_completions:
            mask = mask * ~completions.truncated[:, None]
        # The whole batch's rewards, lengths, truncations, completion tokens, prompt lengths (and episodes' turns),
        # in one all-gather of float32 columns (exact: the rewards are float32, the counts small): a group's
        # completions are on one process, a batch's std and the metrics are not.
        lengths = [len(ids) for ids in completions.ids]
        prompt_lengths = [len(prompts.ids[index]) for index in completions.prompt_index]
        turns = [] if episodes is None else [episodes[:, 1]]
        columns = [table, lengths, completions.truncated, mask[:, 1:].sum(1), prompt_lengths, *turns]
        whole = all_rows(np.column_stack(columns).astype(np.float32))
        functions = table.shape[1]
        whole_table, whole_lengths = whole[:, :functions], whole[:, functions]
        whole_truncated, whole_tokens = whole[:, functions + 1], whole[:, functions + 2]
        self.made_tokens = int(whole[:, functions + 3].astype(np.int64).sum() + whole_lengths.astype(np.int64).sum())
        advantages, is_std_zero = group_advantages(
            whole_table, self.weights, section.num_generations, section.scale_rewards
        )
        rows = len(completions.ids)
        own = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
        if self.samples is not None and (step + 1) % self.samples[1] == 0 and jax.process_index() == 0:
            self.write_samples(step, completions, texts, table, advantages[own])
        metrics = {
            **reward_metrics(whole_table, self.weights, self.reward_names),
            "frac_reward_zero_std": float(is_std_zero.mean()),
            **length_metrics(whole_lengths, whole_truncated),
            **(turn_metrics(whole[:, functions + 4]) if episodes is not None else {}),
            **({"rollout/staleness": float(step - (step if made_at is None else made_at))} if self.ahead else {}),
        }
        training = {
            "tokens": tokens,
            "completion_mask": mask.astype(np.int32),
            "advantages": advantages[own],
            "sampler_logps": sampler_logps,
            "batch_rows": np.full(rows, len(whole), np.float32),
            "batch_tokens": np.full(rows, whole_tokens.sum(), np.float32),
            "host_metrics": np.tile(np.array([metrics[name] for name in self.metric_names], np.float32), (rows, 1)),
        }
        if old_logps is not None:
            training["old_logps"] = np.asarray(to_local(old_logps), np.float32)
        return training

    def write_samples(
        self, step: int, completions: Completions, texts: list[Any], table: np.ndarray, advantages: np.ndarray
    ) -> None:
        """Append the first prompt's completions of the step of index ``step`` to the samples file."""
        assert self.samples is not None
        records = sample_records(
            step + 1,
            self.prompts,
            completions,
            texts,
            table,
            self.reward_names,
            self.weights,
            advantages,
            self.section.num_generations,
        )
        with open(self.samples[0], "a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)


def length_metrics(lengths: np.ndarray, truncated: np.ndarray) -> dict[str, float]:
    """TRL's metrics of the batch's completion lengths: of all, the share that ended without an EOS, and of those
    that ended with one (0 when none did)."""
    terminated = lengths[truncated == 0]
    if len(terminated) == 0:  # TRL's rule: no terminated completion reads as one of length 0
        terminated = np.zeros(1, lengths.dtype)
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.mean()),
        "completions/mean_terminated_length": float(terminated.mean()),
        "completions/min_terminated_length": float(terminated.min()),
        "completions/max_terminated_length": float(terminated.max()),
    }


def turn_metrics(turns: np.ndarray) -> dict[str, float]:
    """The model's turns per episode: their mean, least and most."""
    return {"turns/mean": float(turns.mean()), "turns/min": float(turns.min()), "turns/max": float(turns.max())}


def example_batch(prompts: Prompts, section: GRPOConfig, rows: int, metrics: int) -> dict[str, np.ndarray]:
    """A training batch of ``rows`` completions shaped as the stage makes them (zeros), to build the step for."""
    width = prompts.longest + section.max_completion_length
    batch = {
        "tokens": np.zeros((rows, width), np.int32),
        "completion_mask": np.zeros((rows, width), np.int32),
        "advantages": np.zeros(rows, np.float32),
        "sampler_logps": np.zeros((rows, width - 1), np.float32),
        "batch_rows": np.full(rows, rows, np.float32),
        "batch_tokens": np.ones(rows, np.float32),
        "host_metrics": np.zeros((rows, metrics), np.float32),
    }
    if section.num_iterations > 1:
        batch["old_logps"] = np.zeros((rows, width - 1), np.float32)
    return batch
