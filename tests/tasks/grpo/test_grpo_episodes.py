"""Multi-turn episodes on the host, with a scripted sampler (nothing compiles): the turns and the environment's
answers laid out in one row, the environment's tokens masked out of the loss and carrying no sampler log-prob, the
token budget and the turn limit, and an environment that fails stopping the run in one line naming it, the turn
and the prompt."""

import json
import os

import jax
import numpy as np
import pytest

from functrain.errors import ConfigError, UserCodeError
from functrain.tasks.grpo.config import GRPOConfig
from functrain.tasks.grpo.environment import EnvironmentFactory, environment_factory, make_environments
from functrain.tasks.grpo.episodes import play
from functrain.tasks.grpo.prompts import read_prompts
from functrain.tasks.grpo.rollout import Completions, training_rows


class ScriptedSampler:
    """Draws ``turns[t][row]`` (4 bytes: a turn's length) at turn ``t``, each token with log-prob ``-(t + 1)``;
    records every call's prompts."""

    def __init__(self, turns):
        self.turns, self.calls = turns, []

    def sample(self, params, padded, lengths, key, *, prefill, repeats=1):
        self.calls.append((padded.copy(), lengths.copy(), prefill))
        turn = len(self.calls) - 1
        tokens = np.zeros((len(padded), padded.shape[1] + 4 - prefill), np.int32)
        for row, text in enumerate(self.turns[turn]):
            start = lengths[row] - prefill
            tokens[row, start: start + 4] = list(text)
        return tokens, np.full(tokens.shape, -(turn + 1.0), np.float32)


class Echo:
    """Opens with "[", answers each turn with "<" + its text + ">" and ends a turn that says "stop"; pays 1 a turn."""

    def reset(self, prompt, **columns):
        return "["

    def step(self, completion):
        return f"<{completion}>", 1.0, completion == "stop"


@pytest.fixture
def prompts(tmp_path):
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("ab", "cde")))
    return read_prompts(tmp_path / "p.jsonl", None)


def run(prompts, turns, environment=Echo, budget=16):
    section = GRPOConfig(num_generations=2, max_completion_length=budget, max_turns=3, max_turn_length=4)
    factory = EnvironmentFactory(environment.__name__, environment)
    sampler = ScriptedSampler(turns)
    environments = make_environments(factory, 4, step=0)
    episodes = play(sampler, None, prompts, np.array([0, 1]), jax.random.PRNGKey(0), section, factory,
                    environments, step=6)
    return episodes, sampler


def test_turns_and_answers_share_a_row_and_only_the_models_tokens_are_trained_on(prompts):
    # Rows 0 and 1 run prompt "ab", rows 2 and 3 "cde"; a turn ends at its EOS (kept) or after 4 tokens.
    turns = [[b"stop", b"hi\0.", b"go..", b"stop"], [b"....", b"stop", b"x\0yz", b"...."]]
    episodes, sampler = run(prompts, turns)
    # The answer of the step that ends an episode is not added; row 2 fills the budget of 16 tokens (truncated).
    assert [bytes(ids.tolist()) for ids in episodes.ids] == [b"[stop", b"[hi\0<hi>stop", b"[go..<go..>x\0<x>",
                                                             b"[stop"]
    assert list(episodes.ended) == [True, True, False, True]
    assert list(episodes.turns) == [1, 2, 2, 1] and list(episodes.rewards) == [1.0, 2.0, 2.0, 1.0]
    model = [bytes(t for t, m in zip(ids.tolist(), mask) if m) for ids, mask in zip(episodes.ids, episodes.from_model)]
    assert model == [b"stop", b"hi\0stop", b"go..x\0", b"stop"]
    for mask, logps in zip(episodes.from_model, episodes.sampler_logps):
        assert np.isnan(logps[mask == 0]).all() and (logps[mask == 1] < 0).all()
    # Every turn runs every row at one shape, its prompt and episode so far (a closed episode's row: its prompt).
    assert len(sampler.calls) == 2
    (first, first_lengths, prefill), (second, second_lengths, _) = sampler.calls
    assert first.shape == second.shape == (4, 3 + 16 - 1) and prefill == 2
    assert list(first_lengths) == [3, 3, 4, 4] and list(second_lengths) == [2, 10, 14, 3]
    assert bytes(second[2, :14].tolist()) == b"cde[go..<go..>"
    # The training row: the prompt, then the episode, masked to the model's tokens; no sampler log-prob elsewhere.
    completions = Completions(episodes.prompt_index, episodes.ids, ~episodes.ended, episodes.sampler_logps,
                              episodes.from_model)
    tokens, mask, sampler_logps = training_rows(prompts, completions, 16)
    assert bytes(tokens[1].tolist()) == b"ab[hi\0<hi>stop" + bytes(5)
    assert mask[1].tolist() == [0] * 3 + [1] * 3 + [0] * 4 + [1] * 4 + [0] * 5
    assert (np.isnan(sampler_logps[1]) == (mask[1, 1:] == 0)).all()


def test_the_turn_limit_and_the_token_budget_end_an_episode_truncated(prompts):
    turns = [[b"aaaa"] * 4, [b"bbbb"] * 4, [b"cccc"] * 4, [b"dddd"] * 4]
    episodes, sampler = run(prompts, turns, budget=40)  # three turns: the third's answer is not added
    assert len(sampler.calls) == 3 and list(episodes.turns) == [3] * 4 and not episodes.ended.any()
    assert bytes(episodes.ids[0].tolist()) == b"[aaaa<aaaa>bbbb<bbbb>cccc" and list(episodes.rewards) == [3.0] * 4
    episodes, sampler = run(prompts, turns)  # 16 tokens: the second answer is cut, no third turn
    assert len(sampler.calls) == 2 and list(episodes.turns) == [2] * 4 and not episodes.ended.any()
    assert bytes(episodes.ids[0].tolist()) == b"[aaaa<aaaa>bbbb<" and list(episodes.rewards) == [2.0] * 4


class Raises(Echo):
    def step(self, completion):
        if completion == "boom":
            raise ValueError("the tool\nis down")
        return super().step(completion)


class NotText(Echo):
    def step(self, completion):
        return 3, 0.0, False


class Pair(Echo):
    def step(self, completion):
        return "ok", 1.0


class NaNReward(Echo):
    def step(self, completion):
        return "ok", float("nan"), False


class NumberDone(Echo):
    def step(self, completion):
        return "ok", 0.0, 1


class ResetRaises(Echo):
    def reset(self, prompt, **columns):
        return {}[prompt]


class ResetNumber(Echo):
    def reset(self, prompt, **columns):
        return 7


@pytest.mark.parametrize("environment, expected", [
    (Raises, "the environment Raises ({file}:{line}) raised ValueError: the tool is down in step at turn 2 of "
             "prompt 1 of p.jsonl (counted from 0)"),
    (NotText, "the environment NotText ({file}:{line}) returned a int as the text of step at turn 1 of prompt 0 of "
              "p.jsonl (counted from 0), not a string"),
    (Pair, "the environment Pair ({file}:{line}) returned a tuple from step at turn 1 of prompt 0 of p.jsonl "
           "(counted from 0), not (text, reward, done)"),
    (NaNReward, "the environment NaNReward ({file}:{line}) returned the reward nan from step at turn 1 of prompt 0 "
                "of p.jsonl (counted from 0), not a finite number"),
    (NumberDone, "the environment NumberDone ({file}:{line}) returned done=1 from step at turn 1 of prompt 0 of "
                 "p.jsonl (counted from 0), not a bool"),
    (ResetRaises, "the environment ResetRaises ({file}:{line}) raised KeyError: 'ab' in reset, before the first turn "
                  "of prompt 0 of p.jsonl (counted from 0)"),
    (ResetNumber, "the environment ResetNumber ({file}:{line}) returned a int from reset for prompt 0 of p.jsonl "
                  "(counted from 0), not a string or None"),
])
def test_an_environment_that_fails_is_one_line_naming_it_the_turn_and_the_prompt(prompts, environment, expected):
    turns = [[b"go.."] * 4, [b"go..", b"go..", b"boom", b"go.."]]
    with pytest.raises(UserCodeError) as info:
        run(prompts, turns, environment)
    method = environment.reset if environment.__name__.startswith("Reset") else environment.step
    code = method.__code__
    line = code.co_firstlineno + (1 if environment in (Raises, ResetRaises) else 0) + (environment is Raises)
    assert info.value.what == expected.format(file=os.path.relpath(__file__), line=line)
    assert info.value.step == 7  # the step of index 6


def test_an_environment_factory_is_checked_before_the_run(tmp_path):
    (tmp_path / "envs.py").write_text("class NoStep:\n    def reset(self, prompt):\n        return None\n"
                                      "raise_later = 3\n")
    with pytest.raises(ConfigError, match=r"the class NoStep has no step method; define reset\(prompt, \*\*columns\)"):
        environment_factory(f"{tmp_path / 'envs.py'}:NoStep")
    with pytest.raises(ConfigError, match="is a int; name a class"):
        environment_factory(f"{tmp_path / 'envs.py'}:raise_later")
    assert environment_factory("tests.tasks.grpo.test_grpo_episodes:Echo").name == "Echo"
