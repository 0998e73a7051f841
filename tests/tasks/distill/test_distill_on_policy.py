"""On-policy distillation (``distill.lmbda``): a share of the steps train on windows that end in the student's own
sampled text, chosen and sampled from (seed, step), so a cut run resumes bitwise."""

import jax
import numpy as np
import pytest
from tests.tasks.distill.test_distill_run import write_config, write_teacher

from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest
from functrain.errors import ConfigError
from functrain.run.fit import fit
from functrain.run.jax_backend import EXPERIENCE_STREAM
from functrain.tasks.distill.on_policy import OnPolicy


class StubSampler:
    """Continues every prompt with 7s, recording what it was asked."""

    def __init__(self):
        self.calls = []

    def sample(self, params, prompts, lengths, key, prefill):
        self.calls.append((prompts.copy(), prefill))
        return np.full((len(prompts), 3), 7, np.int32), np.zeros((len(prompts), 3), np.float32)


def step_key(seed, step):
    return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), EXPERIENCE_STREAM), step)


def test_a_share_of_the_steps_end_their_windows_in_the_students_text():
    sampler = StubSampler()
    stage = OnPolicy(sampler, "tokens", lmbda=0.5, new_tokens=3)
    windows = np.arange(20, dtype=np.int32).reshape(2, 10)
    on_policy = []
    for step in range(20):
        out = stage(None, {"tokens": windows, "weight": np.ones(2, np.float32)}, step_key(0, step), step)
        on_policy.append(not np.array_equal(out["tokens"], windows))
        if on_policy[-1]:
            np.testing.assert_array_equal(out["tokens"][:, :7], windows[:, :7])
            assert (out["tokens"][:, 7:] == 7).all()
    assert 5 <= sum(on_policy) <= 15 and len(sampler.calls) == sum(on_policy)
    assert sampler.calls[0][1] == 7 and sampler.calls[0][0].shape == (2, 7)
    again = OnPolicy(StubSampler(), "tokens", lmbda=0.5, new_tokens=3)
    assert [not np.array_equal(again(None, {"tokens": windows}, step_key(0, s), s)["tokens"], windows)
            for s in range(20)] == on_policy  # the same steps, from the same keys
    with pytest.raises(ConfigError, match="distill.max_new_tokens=10 leaves no prompt in windows of 10 tokens"):
        OnPolicy(StubSampler(), "tokens", lmbda=1.0, new_tokens=10)(None, {"tokens": windows}, step_key(0, 0), 0)


def test_an_on_policy_run_resumes_bitwise(tmp_path):
    teacher = tmp_path / "teacher"
    write_teacher(teacher)
    settings = {"lmbda": 0.5, "max_new_tokens": 4}
    for name in ("whole", "cut"):
        (tmp_path / name).mkdir()
    whole = write_config(tmp_path / "whole", teacher, distill=settings)
    cut = write_config(tmp_path / "cut", teacher, distill=settings)
    schedule = OnPolicy(StubSampler(), "tokens", lmbda=0.5, new_tokens=3)
    windows = np.zeros((2, 10), np.int32)
    on = [step for step in range(4) if (schedule(None, {"tokens": windows}, step_key(1, step), step)["tokens"] == 7).any()]
    assert any(step < 2 for step in on) and any(step >= 2 for step in on)  # sampling before and after the cut
    fit(str(whole), seed=1)
    fit(str(cut), seed=1, **{"train.max_steps": 2})
    fit(str(cut), seed=1)
    assert params_digest(load_params(tmp_path / "cut" / "run")) == params_digest(load_params(tmp_path / "whole" / "run"))


def test_on_policy_needs_plain_token_windows(tmp_path):
    teacher = tmp_path / "teacher"
    write_teacher(teacher)
    config = write_config(tmp_path, teacher, distill={"lmbda": 0.5})
    hf = {"input_ids": np.ones((8, 12), np.int32), "attention_mask": np.ones((8, 12), np.int32)}
    with pytest.raises(ConfigError, match="distill.lmbda samples the student's continuations of token windows"):
        fit(str(config), train_data=hf)
    assert not (tmp_path / "run").exists()


def test_on_many_processes_each_continues_its_own_windows():
    # The stage runs across processes: it hands the sampler this process's windows and keeps their continuations,
    # and chooses its steps from the key alone (the same on every process). The sampler's global rows are tested by
    # GRPO's two-process run (tests/tasks/grpo/test_grpo_processes.py).
    assert OnPolicy.across_processes
    sampler = StubSampler()
    stage = OnPolicy(sampler, "tokens", lmbda=1.0, new_tokens=3)
    local = np.arange(20, dtype=np.int32).reshape(2, 10)  # this process's rows of a larger batch
    out = stage(None, {"tokens": local}, step_key(0, 0), 0)
    assert sampler.calls[0][0].shape == (2, 7) and out["tokens"].shape == (2, 10)
