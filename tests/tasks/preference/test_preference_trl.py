"""Parity with TRL 1.16: the same pairs and weights through TRL's DPOTrainer and functrain give the same
tokens, loss, rewards and log-probs, at the first step and after training steps with both (fp32, CPU)."""

import copy
import json
import shutil
import string
import types

import numpy as np
import pytest
import torch
import transformers
from datasets import Dataset
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

import functrain
from functrain.commands.cli import main
from functrain.tasks.preference.loss import PreferenceSettings, pair_losses
from functrain.tasks.preference.pairs import load_preference_tokenizer, preference_arrays

PAIRS = [{"prompt": "2+2=", "chosen": "4", "rejected": "five"},
         {"prompt": "sky? ", "chosen": "blue", "rejected": "red"},
         {"prompt": "a", "chosen": "bc", "rejected": "bd"},
         {"prompt": "hi ", "chosen": "there", "rejected": "you"}]
STEPS, LEARNING_RATE, SEQ_LEN = 3, 1e-3, 32
# Loss type -> the TRL DPOConfig arguments it is run with (label_smoothing for robust).
DPO_LOSSES = {"sigmoid": {}, "ipo": {}, "hinge": {}, "robust": {"label_smoothing": 0.1}}
# IPO (length-averaged, the most sensitive to how a batch is divided) accumulates 2 micro-batches of 2 pairs:
# exact accumulation divides once by the pairs, so it still equals TRL's mean over the batch of 4.
MICRO_BATCHES = {"ipo": 2}
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def write_tokenizer(directory):
    """A character-level fast tokenizer with an EOS token (no download)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "</s>", *string.printable])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                                     eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tokenizer, tiny Llama (HF dir, converted), the pairs file and a TRL trainer built once."""
    from trl import DPOConfig, DPOTrainer
    root = tmp_path_factory.mktemp("trl")
    tokenizer = write_tokenizer(root / "tok")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=2, eos_token_id=2,
        pad_token_id=0))
    model.save_pretrained(root / "hf")
    (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in PAIRS))
    assert main(["convert", "hf-to-functrain", str(root / "hf"), str(root / "converted")]) == 0
    initial = copy.deepcopy(model.state_dict())
    args = DPOConfig(output_dir=str(root / "trl_out"), per_device_train_batch_size=len(PAIRS), max_steps=STEPS,
                     learning_rate=LEARNING_RATE, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                     report_to=[], use_cpu=True, seed=0, save_strategy="no", max_length=SEQ_LEN, disable_tqdm=True,
                     bf16=False, gradient_checkpointing=False)  # TRL defaults to bf16; the parity is fp32
    trainer = DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args,
                         train_dataset=Dataset.from_list(PAIRS), processing_class=tokenizer)
    return types.SimpleNamespace(root=root, tokenizer=tokenizer, trainer=trainer, initial=initial)


def trl_history(setup, loss_type, options):
    """TRL's logged metrics per step for one loss type (the trainer reused: weights reset, fresh optimizer)."""
    trainer = setup.trainer
    trainer.model.load_state_dict(setup.initial)
    trainer.optimizer, trainer.lr_scheduler = None, None
    trainer.loss_types, trainer.loss_weights = [loss_type], [1.0]
    trainer.label_smoothing = options.get("label_smoothing", 0.0)
    trainer.state.log_history = []
    trainer.train()
    return [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]


def test_tokenisation_matches_trl(setup):
    arrays, _ = preference_arrays(setup.root / "pairs.jsonl", load_preference_tokenizer(setup.root / "tok"), SEQ_LEN)
    for row, example in enumerate(setup.trainer.train_dataset):
        for key in ("chosen", "rejected"):
            want = example["prompt_ids"] + example[f"{key}_ids"]
            assert arrays[key][row, :len(want)].tolist() == want
            assert arrays[f"{key}_mask"][row].tolist() == [0] * len(example["prompt_ids"]) + \
                [1] * len(example[f"{key}_ids"]) + [0] * (SEQ_LEN - len(want))
            assert example[f"{key}_ids"][-1] == setup.tokenizer.eos_token_id  # EOS appended as TRL does


@pytest.mark.parametrize("loss_type", list(DPO_LOSSES))
def test_loss_rewards_and_logps_match_trl_over_training(setup, loss_type, tmp_path):
    options = DPO_LOSSES[loss_type]
    expected = trl_history(setup, loss_type, options)
    run = tmp_path / "run"
    shutil.copytree(setup.root / "converted", run)  # the step-0 checkpoint of the HF weights
    overrides = {"run.dir": str(run), "data.name": "preference", "data.path": str(setup.root / "pairs.jsonl"),
                 "data.tokenizer": str(setup.root / "tok"), "data.seq_len": SEQ_LEN,
                 "data.global_batch_size": len(PAIRS), "data.eval_fraction": 0.0, "train.max_steps": STEPS,
                 "train.micro_batches": MICRO_BATCHES.get(loss_type, 1), "train.clip_norm": 1.0, "optimizer.learning_rate": LEARNING_RATE, "preference.loss_type": loss_type,
                 "log.every_steps": 1, "log.progress": False, "log.tensorboard": False,
                 "checkpoint.async_save": False, "checkpoint.every_steps": 0,
                 **{f"preference.{key}": value for key, value in options.items()}}
    functrain.fit(str(run / "config.yaml"), **overrides)
    ours = [line for line in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if line["split"] == "train"]
    assert len(ours) == len(expected) == STEPS
    # Within 1e-5, relative where the value is large (IPO's loss is about 20: float32 resolves 2e-6 there, and
    # the square magnifies a log-prob's last bits tenfold).
    gaps = {(step, name): abs(mine[name] - theirs[name]) / max(1.0, abs(theirs[name]))
            for step, (mine, theirs) in enumerate(zip(ours, expected), start=1) for name in METRICS}
    assert max(gaps.values()) < 1e-5, {key: gap for key, gap in gaps.items() if gap >= 1e-5}
    if loss_type == "sigmoid":
        assert ours[0]["loss"] == pytest.approx(np.log(2), abs=1e-6) and ours[0]["rewards/accuracies"] == 0.0
    assert ours[-1]["loss"] < ours[0]["loss"] or loss_type == "hinge"


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_match_trl_formulas(loss_type):
    """SimPO (CPOTrainer.cpo_loss) and ORPO (ORPOTrainer.odds_ratio_loss) on the same average log-probs."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 9, (2, 5)).astype(np.float32)
    sums = -rng.uniform(0.5, 3.0, (2, 5)).astype(np.float32) * counts
    settings = PreferenceSettings(loss_type, beta=0.3, label_smoothing=0.1 if loss_type == "simpo" else 0.0,
                                  simpo_gamma=0.7)
    losses, chosen_rewards, rejected_rewards = pair_losses(settings, sums[0], sums[1], None, None, *counts)
    average = torch.tensor(sums / counts)
    device = types.SimpleNamespace(device="cpu")
    if loss_type == "simpo":
        trainer = types.SimpleNamespace(beta=0.3, label_smoothing=0.1, simpo_gamma=0.7, loss_type="simpo",
                                        alpha=0.0, accelerator=device)
        want, want_chosen, want_rejected = CPOTrainer.cpo_loss(trainer, average[0], average[1])
    else:
        trainer = types.SimpleNamespace(beta=0.3, accelerator=device)
        ratio, want_chosen, want_rejected = ORPOTrainer.odds_ratio_loss(trainer, average[0], average[1])[:3]
        want = -average[0] - ratio  # ORPO: NLL(chosen) - beta * log sigmoid(log odds ratio); the NLL per pair
    np.testing.assert_allclose(losses, want.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(chosen_rewards, want_chosen.numpy(), rtol=1e-6)
    np.testing.assert_allclose(rejected_rewards, want_rejected.numpy(), rtol=1e-6)
