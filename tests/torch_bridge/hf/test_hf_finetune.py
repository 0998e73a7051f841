"""End to end: HF directory -> `functrain convert` -> fine-tune with `functrain.fit` -> back to transformers."""

from pathlib import Path

import numpy as np
import torch
import transformers

import functrain
from functrain.commands.cli import main
from functrain.config.load import load_config
from functrain.models import gpt2

REPO = Path(__file__).resolve().parents[3]
IDS = np.random.default_rng(1).integers(0, 256, (2, 10))
QUIET = {"log.every_steps": 1, "log.progress": False, "log.tensorboard": False, "data.seq_len": 32,
         "data.global_batch_size": 8, "data.eval_fraction": 0.0, "checkpoint.async_save": False}


def logits(model: transformers.PreTrainedModel) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def tiny_llama_dir(path: Path) -> transformers.PreTrainedModel:
    """A byte-vocabulary Llama (the bundled char_text data feeds byte ids) saved as an HF directory."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=0,
        eos_token_id=0, pad_token_id=0)).eval()
    model.save_pretrained(path)
    return model


def test_cli_convert_then_fit_starts_from_the_converted_weights(tmp_path, capsys):
    model = tiny_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    assert "wrote checkpoint step 0" in capsys.readouterr().out

    # A vanishing learning rate: the exported weights are the converted ones, through the whole loop.
    result = functrain.fit(str(tmp_path / "run" / "config.yaml"), **QUIET, **{
        "train.max_steps": 1, "optimizer.learning_rate": 1e-9})
    assert result.step == 1
    assert main(["convert", "functrain-to-hf", str(tmp_path / "run"), str(tmp_path / "out"), "--step", "1"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    np.testing.assert_allclose(logits(exported), logits(model), atol=1e-4)


def test_fine_tuning_a_converted_model_lowers_the_loss(tmp_path):
    tiny_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    result = functrain.fit(str(tmp_path / "run" / "config.yaml"), **QUIET, **{
        "train.max_steps": 8, "optimizer.learning_rate": 1e-2})
    assert result.stop_reason == "finished" and result.step == 8
    losses = [line["loss"] for line in map(__import__("json").loads,
                                           (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if line["split"] == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5


def test_cli_bad_hf_dir_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("functrain: error:") and "config.json not found" in err and "\n" not in err
    assert not (tmp_path / "run").exists()


def test_finetune_example_config_matches_gpt2_small():
    config = load_config(REPO / "configs" / "finetune_gpt2.yaml")
    assert config.model == gpt2.from_hf_config(transformers.GPT2Config().to_dict())
