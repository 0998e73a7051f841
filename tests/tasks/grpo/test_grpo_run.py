"""GRPO runs end to end on a tiny byte-level GPT: TRL's metrics, the sampler agreeing with the training forward,
bitwise resume (also with num_iterations 2), and reward functions that fail stopping the run in one line."""

import json
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from functrain.checkpoint import load_params
from functrain.checkpoint.digest import params_digest
from functrain.checkpoint.layout import CHECKPOINTS_SUBDIR, committed_steps
from functrain.commands.cli import main
from functrain.errors import UserCodeError
from functrain.run.fit import fit
from functrain.tasks.grpo.rewards import RewardFunction, scores

REPO = Path(__file__).resolve().parents[3]
WORDS = ["The ", "A list ", "To ", "If the ", "When ", "This ", "It ", "In "]
REWARDS = '''
def no_e(completions, **columns):
    return [float("e" not in text) for text in completions]

def length(completions, completion_ids, **columns):
    return [len(ids) / 6 if i % 3 else None for i, ids in enumerate(completion_ids)]

def raises(completions, **columns):
    raise ValueError("the grader\\nis down")

def short(completions, **columns):
    return [1.0]

def nan(completions, **columns):
    return [float("nan")] * len(completions)

def two_arguments(a, b):
    return []

def strings(completions, **columns):
    return ["good"] * len(completions)

def no_list(completions, **columns):
    return None

class Tally:
    """Opens with ":", answers a turn with ","; pays 1 for a turn without an e, ends after a turn with an x."""
    def reset(self, prompt, answer, **columns):
        self.turns = 0
        return ":"

    def step(self, completion):
        self.turns += 1
        return ",", float("e" not in completion), "x" in completion

def turns(completions, environments, **columns):
    return [environment.turns / 3 for environment in environments]

class Broken(Tally):
    def step(self, completion):
        raise RuntimeError("the tool is down")

class NoStep:
    def reset(self, prompt, **columns):
        return None
'''
LLAMA = {"name": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16, "lora": {"rank": 4}}
TRL_METRICS = ("loss", "reward", "reward_std", "rewards/no_e/mean", "rewards/no_e/std", "rewards/length/mean",
               "rewards/length/std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
               "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
               "completions/min_terminated_length", "completions/max_terminated_length", "entropy",
               "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
               "clip_ratio/high_max", "rollout/logprob_gap", "num_tokens")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": w, "answer": str(i)}) + "\n"
                                                for i, w in enumerate(WORDS)))
    (root / "grpo_test_rewards.py").write_text(textwrap.dedent(REWARDS))
    with pytest.MonkeyPatch.context() as patch:  # the reward functions' module importable
        patch.syspath_prepend(str(root))
        yield root


def config(workspace, run_dir, **overrides):
    base = {"run.dir": str(run_dir), "model.name": "gpt", "model.vocab_size": 256, "model.max_len": 16,
            "model.d_model": 32, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 64, "model.dropout": 0.0,
            "data.name": "prompts", "data.path": str(workspace / "prompts.jsonl"), "data.seq_len": 16,
            "data.global_batch_size": 8, "grpo.num_generations": 4, "grpo.max_completion_length": 6,
            "grpo.reward_funcs": ["grpo_test_rewards:no_e", "grpo_test_rewards:length"],
            "grpo.reward_weights": [1.0, 0.5], "optimizer.learning_rate": 0.01, "train.max_steps": 4,
            "train.steps_per_call": 2, "checkpoint.every_steps": 2, "checkpoint.async_save": False,
            "log.every_steps": 2, "log.progress": False, "log.tensorboard": False, "log.plot": False}
    return {**base, **overrides}


def train_lines(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["split"] == "train"]


@pytest.fixture(scope="module")
def whole_run(workspace):
    """Four steps at num_iterations 1, uninterrupted (shared by the tests that read a finished run)."""
    run_dir = workspace / "whole"
    fit({}, **config(workspace, run_dir))
    return run_dir


def test_a_run_logs_trls_metrics_and_its_sampler_agrees_with_the_training_forward(whole_run):
    lines = train_lines(whole_run)
    assert [line["step"] for line in lines] == [2, 4]
    for line in lines:
        assert set(TRL_METRICS) <= set(line)
        assert 0.0 <= line["rollout/logprob_gap"] <= 1e-6  # float32: the cached decoder and the train step agree
        assert line["clip_ratio/region_mean"] == 0.0  # num_iterations 1: the ratio is exactly 1
        assert 1 <= line["completions/min_length"] <= line["completions/mean_length"] <= 6
        assert 0.0 <= line["rewards/no_e/mean"] <= 1.0
    # num_tokens: prompts and completions of every generation so far (4 steps of 8 rows, prompts of 1-7 bytes)
    counts = [line["num_tokens"] for line in lines]
    assert 2 * 8 * 2 <= counts[0] < counts[1] <= 4 * 8 * (8 + 6) and counts[1] == int(counts[1])
    samples = [json.loads(line) for line in (whole_run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["index"]) for s in samples] == [(step, i) for step in (2, 4) for i in range(4)]
    first = samples[0]
    assert first["prompt"] in WORDS and set(first["rewards"]) == {"no_e", "length"}
    assert first["reward"] == pytest.approx(first["rewards"]["no_e"] + 0.5 * (first["rewards"]["length"] or 0))
    recorded = yaml.safe_load((whole_run / "config.yaml").read_text())
    assert recorded["task"] == "grpo" and recorded["grpo"]["num_generations"] == 4


@pytest.mark.parametrize("share_prompt", [True, False])
def test_on_the_bundled_examples_shapes_the_sampler_and_the_train_step_agree_bit_for_bit(
        tmp_path, monkeypatch, share_prompt):
    # configs/grpo_char_gpt.yaml (beta 0.04) from random weights (its run starts from make train's): the decoder's
    # log-probs are the train step's, with and without a shared prompt. (The tiny run above differs in a last bit: its
    # products and element-wise ops are too small for XLA:CPU to give YNNPACK alike in decoding and in training, and
    # without a KL term its forward keeps activations for the backward; docs/grpo.md.)
    monkeypatch.chdir(REPO)
    fit(REPO / "configs" / "grpo_char_gpt.yaml", **{
        "run.dir": str(tmp_path / "run"), "train.init_from": None, "train.max_steps": 2,
        "grpo.share_prompt": share_prompt, "checkpoint.every_steps": 0, "log.plot": False, "log.progress": False,
        "log.tensorboard": False})
    assert [line["rollout/logprob_gap"] for line in train_lines(tmp_path / "run")] == [0.0, 0.0]


def _same_training(run_dir, other):
    assert params_digest(load_params(run_dir)) == params_digest(load_params(other))
    drop = ("steps_per_sec", "samples_per_sec")
    assert [{k: v for k, v in line.items() if k not in drop} for line in train_lines(run_dir)] == \
        [{k: v for k, v in line.items() if k not in drop} for line in train_lines(other)]


@pytest.fixture(scope="module")
def cut_run(workspace):
    """The first two of whole_run's steps, run alone (a run cut at step 2): a test that resumes it takes a copy."""
    run_dir = workspace / "cut"
    fit({}, **config(workspace, run_dir, **{"train.max_steps": 2}))
    return run_dir


def test_a_cut_run_resumes_bitwise(workspace, whole_run, cut_run, tmp_path):
    shutil.copytree(cut_run, tmp_path / "cut")
    fit({}, **config(workspace, tmp_path / "cut"))  # resumes from its checkpoint at step 2
    _same_training(tmp_path / "cut", whole_run)


def test_a_cut_run_resumes_bitwise_with_two_updates_per_generation_and_lora_as_the_reference(workspace, tmp_path):
    # LoRA: the sampler merges the adapters, the reference is the base (adapters off), checkpoints hold adapters.
    options = {"grpo.num_iterations": 2, "grpo.beta": 0.05}

    def llama_config(run_dir, **more):
        settings = config(workspace, run_dir, **options, **more)
        return {**{k: v for k, v in settings.items() if not k.startswith("model.")},
                **{f"model.{k}": v for k, v in LLAMA.items()}}

    fit({}, **llama_config(tmp_path / "whole"))
    fit({}, **llama_config(tmp_path / "cut", **{"train.max_steps": 2}))
    fit({}, **llama_config(tmp_path / "cut"))
    _same_training(tmp_path / "cut", tmp_path / "whole")
    last = train_lines(tmp_path / "whole")[-1]
    assert last["kl"] > 0  # the second update of a generation moves away from the weights that drew it
    assert 0.0 <= last["rollout/logprob_gap"] <= 1e-6  # the old policy's forward against the sampler (LoRA merged)


EPISODES = {"grpo.environment_factory": "grpo_test_rewards:Tally", "grpo.max_turns": 3, "grpo.max_turn_length": 2,
            "grpo.max_completion_length": 8, "grpo.reward_funcs": ["grpo_test_rewards:no_e", "grpo_test_rewards:turns"]}


@pytest.fixture(scope="module")
def episodes_run(workspace):
    """Four steps of episodes with an environment (turns of 2 tokens, answers of 1), uninterrupted; and the training
    batches the stage made."""
    from functrain.tasks.grpo.rollout import Rollouts
    batches = []
    generate = Rollouts.generate
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Rollouts, "generate", lambda self, *args: batches.append(generate(self, *args)) or batches[-1])
        fit({}, **config(workspace, workspace / "episodes", **EPISODES))
    return workspace / "episodes", batches


def test_episodes_train_on_the_models_turns_only_and_log_their_rewards_and_turns(episodes_run):
    run_dir, batches = episodes_run
    lines = train_lines(run_dir)
    for line in lines:
        assert {"rewards/Tally/mean", "rewards/no_e/mean", "rewards/turns/mean", "turns/mean", "turns/max"} <= set(line)
        assert 1 <= line["turns/min"] <= line["turns/mean"] <= line["turns/max"] <= 3
        assert 0.0 <= line["rollout/logprob_gap"] <= 1e-6  # the model's tokens: the sampler's are the step's
    # Each row: its prompt, the environment's opening ":", then turns of the model (1 or 2 tokens, trained on), each
    # but the last followed by the environment's "," (masked out); a sampler log-prob on the model's tokens only.
    for batch in batches:
        for tokens, mask, drawn in zip(batch["tokens"], batch["completion_mask"], batch["sampler_logps"]):
            opened = int(np.flatnonzero(tokens == ord(":"))[0])  # no prompt holds a ":"
            last = int(np.flatnonzero(mask)[-1])
            answers = [position for position in range(opened + 1, last) if mask[position] == 0]
            assert mask[opened] == 0 and all(tokens[position] == ord(",") for position in answers)
            assert max(np.diff([opened, *answers, last + 1])) <= 3 and len(answers) <= 2  # turns of 2, at most 3
            assert (np.isnan(drawn) == (mask[1:] == 0)).all()
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all(sample["text"].startswith(":") and "Tally" in sample["rewards"] for sample in samples)


def test_a_cut_run_of_episodes_resumes_bitwise(workspace, episodes_run, tmp_path):
    fit({}, **config(workspace, tmp_path / "cut", **EPISODES, **{"train.max_steps": 2}))
    fit({}, **config(workspace, tmp_path / "cut", **EPISODES))
    _same_training(tmp_path / "cut", episodes_run[0])


def test_an_environment_that_raises_stops_the_run_in_one_line(workspace, episodes_run, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("{}")
    settings = config(workspace, tmp_path / "run", **{**EPISODES, "grpo.environment_factory": "grpo_test_rewards:Broken"})
    assert main(["train", str(path), *[f"{key}={json.dumps(value)}" for key, value in settings.items()]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"functrain: error: at step 1, the environment Broken ({workspace / 'grpo_test_rewards.py'}"
                              f":41) raised RuntimeError: the tool is down in step at turn 1 of prompt ")
    assert err[-1].endswith("of prompts.jsonl (counted from 0); no checkpoint yet: fix it and run the same command "
                            "again (the run starts over)")
    assert not committed_steps(tmp_path / "run" / CHECKPOINTS_SUBDIR)


def test_a_failing_reward_function_stops_the_run_in_one_line_and_the_checkpoint_stays_whole(
        workspace, cut_run, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    path = tmp_path / "config.yaml"
    path.write_text("{}")
    shutil.copytree(cut_run, run_dir)
    overrides = [f"{key}={json.dumps(value)}" for key, value in config(workspace, run_dir).items()]
    # The function is swapped after the first checkpoint: at step 2 it raises.
    rewards = __import__("grpo_test_rewards")
    monkeypatch.setattr(rewards, "no_e", rewards.raises)
    assert main(["train", str(path), *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"functrain: error: at step 3, the reward function raises ({workspace / 'grpo_test_rewards.py'}"
                       f":9) raised ValueError: the grader is down; the last checkpoint, step 2, is whole: fix it and "
                       f"run the same command again to resume from there")
    assert committed_steps(run_dir / CHECKPOINTS_SUBDIR) == [2]
    assert params_digest(load_params(run_dir, 2))


@pytest.mark.parametrize("function, line, expected", [
    ("raises", 9, "raised ValueError: the grader is down"),
    ("short", 11, "returned 1 rewards for 2 completions"),
    ("nan", 14, "returned nan for completion 0: not a finite number or None"),
    ("strings", 20, "returned 'good' for completion 0: not a finite number or None"),
    ("no_list", 23, "returned a NoneType, not a list of rewards"),
])
def test_a_reward_function_that_fails_is_one_line_naming_its_file_line_and_step(workspace, function, line, expected):
    rewards = __import__("grpo_test_rewards")
    with pytest.raises(UserCodeError) as info:  # the step of index 7: step 8 of metrics.jsonl
        scores([RewardFunction(function, getattr(rewards, function))], ["a", "b"], ["x", "y"], [[1], [2]], {}, 7)
    assert info.value.what == f"the reward function {function} ({workspace / 'grpo_test_rewards.py'}:{line}) {expected}"
    assert info.value.step == 8


def test_a_reward_function_failing_at_the_first_step_ends_the_progress_bar_and_says_no_checkpoint(
        workspace, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_text("{}")
    settings = config(workspace, tmp_path / "run", **{"grpo.reward_funcs": ["grpo_test_rewards:length",
                                                                           "grpo_test_rewards:strings"],
                                                      "log.progress": True})
    assert main(["train", str(path), *[f"{key}={json.dumps(value)}" for key, value in settings.items()]]) == 2
    err = capsys.readouterr().err
    assert "0/4" in err  # the bar was drawn; its line ended before the error's
    assert f"\nfunctrain: error: at step 1, the reward function strings ({workspace / 'grpo_test_rewards.py'}:20) " \
           f"returned 'good' for completion 0: not a finite number or None; no checkpoint yet: fix it and run the " \
           f"same command again (the run starts over)\n" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not committed_steps(tmp_path / "run" / CHECKPOINTS_SUBDIR)


ONE_WEIGHT = {"grpo.reward_weights": None}  # one function: the weights of two do not apply


@pytest.mark.parametrize("overrides, expected", [
    ({"grpo.num_generations": 1}, "config key 'grpo.num_generations': Input should be greater than or equal to 2"),
    ({"data.global_batch_size": 6}, "data.global_batch_size=6 counts completions and is not divisible by "
                                    "grpo.num_generations=4; set it to a multiple of 4"),
    ({"grpo.reward_funcs": ["grpo_test_rewards:missing"], **ONE_WEIGHT}, "grpo.reward_funcs entry='grpo_test_rewards:missing' "
                                                           "does not resolve"),
    ({"grpo.reward_funcs": ["no_such_module:f"], **ONE_WEIGHT}, "cannot import 'no_such_module'"),
    ({"grpo.reward_funcs": ["grpo_test_rewards:two_arguments"], **ONE_WEIGHT}, "the reward function "
                                                                 "'grpo_test_rewards:two_arguments' cannot be called"),
    ({"grpo.reward_funcs": [], **ONE_WEIGHT}, "task grpo needs at least one reward function"),
    ({"grpo.reward_weights": [1.0]}, "grpo.reward_weights has 1 weights for 2 reward functions"),
    ({"grpo.max_completion_length": 11}, "the longest prompt of prompts.jsonl (7 tokens) and "
                                         "grpo.max_completion_length=11 tokens need 17 positions"),
    ({"backend": "torch"}, "task grpo runs on backend jax; set backend=jax"),
    ({"data.path": None}, "task grpo needs prompts; set data.path=PROMPTS.jsonl"),
    ({"model.name": "mlp", "model.vocab_size": None, "model.max_len": None, "model.d_model": None,
      "model.n_layers": None, "model.n_heads": None, "model.d_ff": None, "model.dropout": None},
     "task grpo samples completions from a built-in causal LM"),
    ({"train.steps_per_call": 2, "grpo.num_iterations": 4, "log.every_steps": 4, "checkpoint.every_steps": 4},
     "train.steps_per_call=2 is not a multiple of grpo.num_iterations=4"),
    ({"grpo.async_steps": -1}, "config key 'grpo.async_steps': Input should be greater than or equal to 0"),
    ({"grpo.async_is_cap": 0}, "config key 'grpo.async_is_cap': Input should be greater than 0"),
    ({"grpo.async_steps": 1, "grpo.num_iterations": 2}, "grpo.async_steps=1 samples ahead with one update per "
                                                        "generation, and grpo.num_iterations=2; set"),
    ({"grpo.environment_factory": "grpo_test_rewards:Missing"},
     "grpo.environment_factory='grpo_test_rewards:Missing' does not resolve"),
    ({"grpo.environment_factory": "no_envs.py:Game"},
     "grpo.environment_factory 'no_envs.py:Game': no_envs.py is not a file; fix the path"),
    ({"grpo.environment_factory": "grpo_test_rewards:NoStep"}, "the class NoStep has no step method"),
    ({"grpo.environment_factory": "grpo_test_rewards:Tally", "grpo.max_turn_length": 7},
     "grpo.max_turn_length=7 exceeds grpo.max_completion_length=6"),
    ({"grpo.environment_factory": "grpo_test_rewards:Tally", "grpo.max_turn_length": 6},
     "a turn of grpo.max_turn_length=6 tokens after the longest prompt of prompts.jsonl (7 tokens) and "
     "grpo.max_completion_length=6 - 1 tokens of its episode needs 17 positions and the model has 16"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_written(workspace, tmp_path, capsys, overrides, expected):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    settings = {key: value for key, value in {**config(workspace, run_dir), **overrides}.items() if value is not None}
    path = tmp_path / "config.yaml"
    path.write_text("{}")
    assert main(["train", str(path), *[f"{key}={json.dumps(value)}" for key, value in settings.items()]]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and "\n" not in err
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_a_steps_prompts_must_split_over_the_processes_in_one_line(workspace, tmp_path, monkeypatch):
    # Each process samples and scores whole groups: 8 completions of 4 generations are 2 prompts, not 3 processes'.
    import jax
    from functrain.errors import ConfigError
    from functrain.run.fit import build
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    with pytest.raises(ConfigError, match=r"a step's 2 prompts \(data.global_batch_size=8 / grpo.num_generations=4\) "
                                          r"do not split over the job's 3 processes.*multiple of 12") as info:
        build({}, **config(workspace, tmp_path / "run"))
    assert "\n" not in str(info.value) and not (tmp_path / "run").exists()


def test_the_bundled_example_builds_and_its_rewards_score_lipograms(monkeypatch):
    from functrain.config.load import load_config
    from functrain.run.parts import build_parts
    monkeypatch.chdir(REPO)
    parts = build_parts(load_config("configs/grpo_char_gpt.yaml"))
    assert parts.data.records_per_step == 8 and len(parts.data.train) == 400
    no_e, real_words = (reward.function for reward in parts.task.rewards(parts.context, parts.data.train.prompts))
    completions = ["it is a list of", "the value is", "zqx vvv kk jj"]
    assert no_e(completions) == [1.0, 0.0, 1.0]
    assert real_words(completions) == [1.0, 0.5, 0.0]
