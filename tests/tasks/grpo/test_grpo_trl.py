"""Parity with TRL 1.16's GRPOTrainer (fp32, CPU): for the same prompts, fixed completions (token ids), reward
functions and weights, the same advantages, loss and metrics within 1e-5.

Two levels: every combination of loss_type x importance_sampling_level x beta 0 / > 0 x num_iterations 1 / 2
through the loss alone (TRL's ``_compute_loss`` and ours on the same tokens, old and reference log-probs), and whole
two-step runs (prompts, rewards, advantages, the forward, the optimizer's first update) for a few of them. And the
same converted HF model trained with LoRA adapters, sampling its own completions, resumes bitwise."""

import json
import shutil
import string
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

import functrain
from functrain.checkpoint import load_params
from functrain.commands.cli import main
from functrain.models import build_model, model_config_class
from functrain.tasks.grpo import rollout
from functrain.tasks.grpo.advantages import group_advantages
from functrain.tasks.grpo.loss import LossSettings, grpo_sums
from functrain.tasks.sampling import token_logps
from functrain.tasks.grpo.prompts import read_prompts

# Prompts of one length (TRL left-pads prompts, and a row's own positions must not move). Every token the inputs
# hold also sits where an advantage is not 0: a token only a zero-advantage group reads gets a gradient only from
# the KL term, which is 0 at the first step up to the forward's last bits, and Adam's first step turns those into a
# full step, TRL's and ours alike.
PROMPTS = ["abcd", "dcba"]
GENERATIONS, LENGTH, STEPS, LEARNING_RATE, TEMPERATURE = 4, 5, 2, 0.02, 0.7
EPSILON, EPSILON_HIGH, BETA = 0.05, 0.08, 0.04
EOS = "</s>"
# Per prompt, its completions (text; EOS where one ends; a completion of LENGTH tokens without it is truncated).
COMPLETIONS = {"abcd": ["ae" + EOS, "bcdfg", "aei" + EOS, "z" + EOS],
               "dcba": ["ae" + EOS, "ea" + EOS, "ai" + EOS, "ia" + EOS]}  # one reward for all: std 0
REWARDS = '''
def vowels(completions, **kwargs):
    return [float(sum(c in "aeiou" for c in text)) for text in completions]

def long(completions, completion_ids, **kwargs):
    return [len(ids) / 5 if len(ids) > 2 else None for ids in completion_ids]
'''
METRICS = ("loss", "reward", "reward_std", "rewards/vowels/mean", "rewards/vowels/std", "rewards/long/mean",
           "rewards/long/std", "frac_reward_zero_std", "completions/mean_length", "completions/min_length",
           "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
           "completions/min_terminated_length", "completions/max_terminated_length", "kl", "entropy",
           "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
           "clip_ratio/high_max", "num_tokens")
LOSS_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                "clip_ratio/low_min", "clip_ratio/high_max")


def write_tokenizer(directory):
    """A character-level fast tokenizer with an EOS token (no download)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", EOS, *string.printable])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("</s>|."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                                     eos_token=EOS)
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tokenizer, tiny Llama (HF dir, converted), prompts, reward functions and one TRL trainer, built once."""
    from trl import GRPOConfig, GRPOTrainer
    root = tmp_path_factory.mktemp("grpo_trl")
    tokenizer = write_tokenizer(root / "tok")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=2, eos_token_id=2,
        pad_token_id=0)).save_pretrained(root / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")  # TRL loads the reference from its path
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    (root / "grpo_parity_rewards.py").write_text(textwrap.dedent(REWARDS))
    assert main(["convert", "hf-to-functrain", str(root / "hf"), str(root / "converted")]) == 0
    completion_ids = {prompt: [tokenizer(text=text)["input_ids"] for text in texts]
                      for prompt, texts in COMPLETIONS.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        import grpo_parity_rewards as rewards
        args = GRPOConfig(
            output_dir=str(root / "trl_out"), per_device_train_batch_size=len(PROMPTS) * GENERATIONS,
            num_generations=GENERATIONS, max_completion_length=LENGTH, max_steps=STEPS, learning_rate=LEARNING_RATE,
            lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1, report_to=[], use_cpu=True, seed=0,
            save_strategy="no", bf16=False, disable_tqdm=True, temperature=TEMPERATURE, beta=BETA, epsilon=EPSILON,
            epsilon_high=EPSILON_HIGH, reward_weights=[1.0, 0.5])
        trainer = GRPOTrainer(model=model, reward_funcs=[rewards.vowels, rewards.long], args=args,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
                              processing_class=tokenizer)
        prompt_of = {tuple(tokenizer(text=p)["input_ids"]): p for p in PROMPTS}

        def fixed_completions(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            drawn: dict[str, int] = {}
            out = []
            for ids in prompt_ids:
                prompt = prompt_of[tuple(ids)]
                out.append(completion_ids[prompt][drawn.setdefault(prompt, 0)])
                drawn[prompt] += 1
            return out, None

        trainer._generate_single_turn = fixed_completions
        initial = {name: value.clone() for name, value in trainer.model.state_dict().items()}
        yield types.SimpleNamespace(root=root, tokenizer=tokenizer, trainer=trainer, initial=initial,
                                    completion_ids=completion_ids)


def trl_history(setup, loss_type, level, beta, iterations):
    """TRL's logged metrics per step (the trainer reused: weights reset, fresh optimizer) and its advantages and
    rewards of the first generation."""
    trainer = setup.trainer
    trainer.model.load_state_dict(setup.initial)
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.num_iterations = iterations
    trainer.state.log_history = []
    trainer._buffered_inputs, trainer._step = None, 0
    for store in (trainer._logs["advantages"], trainer._logs["prompt"]):
        store.clear()
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry and "train_runtime" not in entry]
    return logged, np.array(list(trainer._logs["advantages"]))[: len(PROMPTS) * GENERATIONS]


def our_history(setup, tmp_path, monkeypatch, loss_type, level, beta, iterations):
    """Our logged metrics per step, the completions fixed as TRL's."""
    prompts = read_prompts(setup.root / "prompts.jsonl", setup.tokenizer)

    def fixed_draw(sampler, params, prompts_, indices, key, generations, length):
        rows = np.repeat(indices, generations)
        ids = [np.asarray(setup.completion_ids[PROMPTS[i]][k], np.int32) for i in indices for k in range(generations)]
        truncated = np.array([row[-1] != setup.tokenizer.eos_token_id for row in ids])
        return rollout.Completions(rows, ids, truncated, [np.zeros(len(row), np.float32) for row in ids])

    monkeypatch.setattr(rollout, "draw", fixed_draw)
    monkeypatch.syspath_prepend(str(setup.root))
    run = tmp_path / "run"
    shutil.copytree(setup.root / "converted", run)  # the step-0 checkpoint of the HF weights
    overrides = {
        "run.dir": str(run), "data.name": "prompts", "data.path": str(setup.root / "prompts.jsonl"),
        "data.tokenizer": str(setup.root / "tok"), "data.seq_len": 16,
        "data.global_batch_size": len(PROMPTS) * GENERATIONS, "train.max_steps": STEPS,
        "train.steps_per_call": iterations, "log.every_steps": iterations,
        "train.clip_norm": 1.0, "optimizer.learning_rate": LEARNING_RATE, "grpo.num_generations": GENERATIONS,
        "grpo.max_completion_length": LENGTH, "grpo.temperature": TEMPERATURE, "grpo.beta": beta,
        "grpo.epsilon": EPSILON, "grpo.epsilon_high": EPSILON_HIGH, "grpo.loss_type": loss_type,
        "grpo.importance_sampling_level": level, "grpo.num_iterations": iterations,
        "grpo.reward_funcs": ["grpo_parity_rewards:vowels", "grpo_parity_rewards:long"],
        "grpo.reward_weights": [1.0, 0.5], "log.progress": False, "log.tensorboard": False,
        "log.plot": False, "checkpoint.async_save": False, "checkpoint.every_steps": 0}
    functrain.fit(str(run / "config.yaml"), **overrides)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert prompts.ids[0].tolist() == setup.tokenizer(text=PROMPTS[0])["input_ids"]
    return [line for line in lines if line["split"] == "train"]


def gaps(ours, theirs, names):
    """Absolute differences, relative where a value is large (float32 resolves 1e-7 of it)."""
    return {name: abs(ours[name] - theirs[name]) / max(1.0, abs(theirs[name])) for name in names if name in theirs}


@pytest.mark.parametrize("loss_type, level, beta, iterations", [
    ("dapo", "token", BETA, 2),
    ("grpo", "sequence", 0.0, 1),
])
def test_whole_steps_match_trl(setup, tmp_path, monkeypatch, loss_type, level, beta, iterations):
    theirs, advantages = trl_history(setup, loss_type, level, beta, iterations)
    ours = our_history(setup, tmp_path, monkeypatch, loss_type, level, beta, iterations)
    assert len(theirs) == STEPS and [line["step"] for line in ours] == list(range(iterations, STEPS + 1, iterations))
    for mine in ours:
        # The step's own loss and metrics; its generation's from the step that generated it (TRL logs a
        # generation's metrics once, at its first step; ours log them at every step it trains).
        step = mine["step"]
        generated = theirs[(step - 1) // iterations * iterations]
        generation_metrics = [name for name in METRICS if name not in ("loss", *LOSS_METRICS)]
        differences = {**gaps(mine, generated, generation_metrics), **gaps(mine, theirs[step - 1], ("loss", *LOSS_METRICS))}
        assert set(differences) >= set(METRICS) - ({"kl"} if beta == 0 else set())
        assert max(differences.values()) < 1e-5, (step, {k: v for k, v in differences.items() if v >= 1e-5})
    assert theirs[0]["frac_reward_zero_std"] == 0.5 and theirs[0]["completions/clipped_ratio"] == 0.125
    # the truncated completion is the longest: the terminated lengths leave it out
    assert theirs[0]["completions/max_terminated_length"] < theirs[0]["completions/max_length"]
    if iterations == 2:  # the second update's ratios moved: clipping is compared where it happens
        assert theirs[1]["clip_ratio/region_mean"] > 0
    table = np.array([[float(sum(c in "aeiou" for c in t.removesuffix(EOS))),
                       len(ids) / 5 if len(ids) > 2 else np.nan]
                      for p in PROMPTS for t, ids in zip(COMPLETIONS[p], setup.completion_ids[p])], np.float32)
    mine, _ = group_advantages(table, np.array([1.0, 0.5], np.float32), GENERATIONS, "group")
    np.testing.assert_allclose(np.sort(mine), np.sort(advantages), atol=1e-5)


def _table(setup):
    """Our rewards of the fixed completions, in TRL's order (each prompt's completions together)."""
    import grpo_parity_rewards as rewards
    from functrain.tasks.grpo.rewards import RewardFunction, scores
    prompts = read_prompts(setup.root / "prompts.jsonl", setup.tokenizer)
    ids = [np.asarray(row, np.int32) for p in PROMPTS for row in setup.completion_ids[p]]
    return scores([RewardFunction("vowels", rewards.vowels), RewardFunction("long", rewards.long)],
                  [p for p in PROMPTS for _ in range(GENERATIONS)], prompts.decode(ids), [i.tolist() for i in ids],
                  {}, 0)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_and_reward_metrics_match_trl(setup, monkeypatch, scale_rewards):
    monkeypatch.syspath_prepend(str(setup.root))
    trainer = setup.trainer
    trainer.model.load_state_dict(setup.initial)
    trainer.scale_rewards, trainer.beta = scale_rewards, 0.0
    trainer._metrics["train"].clear()
    trainer.model.train()
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(GENERATIONS)])
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    table = _table(setup)
    advantages, is_std_zero = group_advantages(table, np.array([1.0, 0.5], np.float32), GENERATIONS, scale_rewards)
    np.testing.assert_allclose(advantages, output["advantages"].numpy(), atol=1e-5, rtol=0)
    assert float(is_std_zero.mean()) == logged["frac_reward_zero_std"]
    from functrain.tasks.grpo.advantages import reward_metrics
    mine = reward_metrics(table, np.array([1.0, 0.5], np.float32), ["vowels", "long"])
    assert max(gaps(mine, logged, list(mine)).values()) < 1e-6


@pytest.fixture(scope="module")
def forward(setup):
    """Our per-token log-probs and entropies of the fixed rows (prompt + completion, padded) at TEMPERATURE, from
    the converted weights, and the rows as TRL's inputs."""
    import yaml
    section = yaml.safe_load((setup.root / "converted" / "config.yaml").read_text())["model"]
    module = build_model(model_config_class(section["name"]).model_validate(section))
    params = load_params(setup.root / "converted")
    prompt = [setup.tokenizer(text=p)["input_ids"] for p in PROMPTS for _ in range(GENERATIONS)]
    completions = [row for p in PROMPTS for row in setup.completion_ids[p]]
    completion_ids = np.zeros((len(completions), LENGTH), np.int64)
    completion_mask = np.zeros_like(completion_ids)
    for row, ids in enumerate(completions):
        completion_ids[row, : len(ids)], completion_mask[row, : len(ids)] = ids, 1
    tokens = np.concatenate([np.array(prompt), completion_ids], 1).astype(np.int32)
    logits = jax.jit(lambda p, x: module.apply({"params": p}, x))(params, tokens[:, :-1])
    logps, entropies = token_logps(logits, jnp.asarray(tokens), TEMPERATURE)
    noise = np.random.default_rng(0).normal(0, 0.1, (2, *logps.shape)).astype(np.float32)
    drift = np.resize(np.float32([0.15, -0.15, 0.0]), (len(tokens), 1))  # whole sequences leave the clip range too
    return types.SimpleNamespace(tokens=tokens, logps=logps, entropies=entropies, old=logps + noise[0] + drift,
                                 ref=logps + 3 * noise[1], prompt=np.array(prompt), completion_ids=completion_ids,
                                 completion_mask=completion_mask)


@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_the_loss_and_its_metrics_match_trl(setup, forward, loss_type, level, beta, iterations):
    trainer, start = setup.trainer, len(PROMPTS[0]) - 1  # position start scores the first completion token
    trainer.model.load_state_dict(setup.initial)
    trainer.model.train()
    trainer.loss_type, trainer.importance_sampling_level, trainer.beta = loss_type, level, beta
    trainer.current_gradient_accumulation_steps = 1
    advantages = np.array([0.9, -1.2, 0.3, 0.0, -0.4, 1.5, -0.7, 0.2], np.float32)
    mask = forward.completion_mask
    inputs = {"prompt_ids": torch.tensor(forward.prompt), "prompt_mask": torch.ones_like(torch.tensor(forward.prompt)),
              "completion_ids": torch.tensor(forward.completion_ids), "completion_mask": torch.tensor(mask),
              "advantages": torch.tensor(advantages), "num_items_in_batch": torch.tensor(float(mask.sum()))}
    if iterations == 2:
        inputs["old_per_token_logps"] = torch.tensor(np.asarray(forward.old)[:, start:])
    if beta:
        inputs["ref_per_token_logps"] = torch.tensor(np.asarray(forward.ref)[:, start:])
    trainer._metrics["train"].clear()
    expected = float(trainer._compute_loss(trainer.model, inputs))
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    settings = LossSettings(loss_type, level, beta, EPSILON, EPSILON_HIGH, TEMPERATURE, iterations, LENGTH)
    rows, full_mask = len(advantages), np.concatenate([np.zeros_like(forward.prompt), mask], 1)
    batch = {"completion_mask": jnp.asarray(full_mask), "advantages": jnp.asarray(advantages),
             "batch_rows": jnp.full(rows, rows, jnp.float32), "batch_tokens": jnp.full(rows, mask.sum(), jnp.float32)}
    old = forward.old if iterations == 2 else jax.lax.stop_gradient(forward.logps)
    loss_sum, weight, sums = grpo_sums(settings, forward.logps, forward.entropies, old,
                                       forward.ref if beta else None, batch)
    ours = {"loss": float(loss_sum / weight), **{name: float(value / weight) for name, value in sums.items()}}
    assert set(ours) == set(LOSS_METRICS) - ({"kl"} if beta == 0 else set()) | {"loss"}
    differences = gaps(ours, {"loss": expected, **logged}, list(ours))
    assert max(differences.values()) < 1e-5, {k: v for k, v in differences.items() if v >= 1e-5}
    if iterations == 2:
        assert logged["clip_ratio/region_mean"] > 0  # the ratios reach the clip range: clipping is compared
        assert logged["clip_ratio/high_max"] > logged["clip_ratio/high_mean"]  # a sequence's share, not the mean


def test_lora_grpo_on_the_converted_hf_model_samples_with_merged_adapters_and_resumes_bitwise(setup, tmp_path,
                                                                                               monkeypatch):
    # The same converted HF Llama with LoRA adapters on every projection, sampling its own completions: its step-0
    # checkpoint holds the base alone (fresh adapters are added), later checkpoints the adapters alone; the sampler
    # runs the merged weights, the reference is the base (the adapters off). A run cut at step 2 resumes bitwise.
    from functrain.checkpoint.digest import params_digest
    monkeypatch.syspath_prepend(str(setup.root))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

    def run(name, steps):
        run_dir = tmp_path / name
        if not run_dir.exists():
            shutil.copytree(setup.root / "converted", run_dir)
        functrain.fit(str(run_dir / "config.yaml"), **{
            "run.dir": str(run_dir), "model.lora": {"rank": 4, "alpha": 8, "targets": targets},
            "data.name": "prompts", "data.path": str(setup.root / "prompts.jsonl"),
            "data.tokenizer": str(setup.root / "tok"), "data.seq_len": 16, "data.global_batch_size": 8,
            "train.max_steps": steps, "train.steps_per_call": 1, "log.every_steps": 1, "checkpoint.every_steps": 2,
            "checkpoint.async_save": False, "optimizer.learning_rate": 0.05, "grpo.num_generations": GENERATIONS,
            "grpo.max_completion_length": LENGTH, "grpo.beta": BETA,
            "grpo.reward_funcs": ["grpo_parity_rewards:vowels", "grpo_parity_rewards:long"],
            "log.progress": False, "log.tensorboard": False, "log.plot": False})
        lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in line.items() if not k.endswith("_per_sec")} for line in lines if
                line["split"] == "train"]

    whole = run("whole", 4)
    run("cut", 2)
    assert run("cut", 4) == whole
    params = load_params(tmp_path / "whole")
    assert params_digest(params) == params_digest(load_params(tmp_path / "cut"))
    assert "lora_a" in params["layers_0"]["self_attn"]["q_proj"]  # the adapters, checkpointed
    assert whole[-1]["kl"] > 0  # the adapters moved the policy off its base
    assert all(0.0 <= line["rollout/logprob_gap"] <= 1e-6 for line in whole)  # merged vs adapted: a last bit
