"""Config loading: YAML, dotted overrides, and one clear error line for every kind of bad config."""

import pytest

from functrain.config.files import apply_overrides
from functrain.config.load import load_config
from functrain.errors import ConfigError

MLP = {"model": {"name": "mlp"}, "data": {"name": "digits"}, "train": {"max_steps": 10}}


def write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def error_of(*args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_yaml_file_and_overrides_are_typed(tmp_path):
    path = write(tmp_path, "model: {name: mlp, hidden: [16]}\ntrain: {max_steps: 5}\n")
    config = load_config(path, ["train.max_steps=7", "optimizer.learning_rate=0.5", "model.hidden=[8, 4]",
                                "checkpoint.resume=never", "train.clip_norm=1"])
    assert config.train.max_steps == 7 and isinstance(config.train.max_steps, int)
    assert config.optimizer.learning_rate == 0.5
    assert config.model.hidden == [8, 4]
    assert config.checkpoint.resume == "never"
    assert config.train.clip_norm == 1.0


def test_overrides_build_missing_sections():
    assert apply_overrides({}, ["a.b.c=3"]) == {"a": {"b": {"c": 3}}}


def test_resume_step_may_be_an_integer():
    assert load_config(base=MLP, overrides=["checkpoint.resume=300"]).checkpoint.resume == 300


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "model:\n  name: mlp\n  hidden: [1, 2\ntrain: {}\n")
    message = error_of(path)
    assert "not valid YAML" in message and "line" in message and str(path) in message


def test_a_key_twice_in_a_config_or_an_override_names_the_key_and_its_lines_and_writes_nothing(tmp_path, capsys):
    from functrain.commands.cli import main

    run_dir = tmp_path / "run"
    path = write(tmp_path, f"run: {{dir: {run_dir}}}\ntrain:\n  max_steps: 5\nmodel: {{name: mlp}}\n"
                           "data: {name: digits}\ntrain:\n  epochs: 1\n")
    assert main(["train", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "has key 'train' twice in one mapping, at lines 2 and 6" in lines[0], lines
    assert "key 'hidden' twice in one mapping, at lines 1 and 1" in error_of(
        write(tmp_path, "model: {name: mlp, hidden: [8], hidden: [4]}\n"))
    assert "key 'name' appears twice" in error_of(base=MLP, overrides=["model={name: mlp, name: gpt}"])
    assert load_config(write(tmp_path, "model: {<<: {name: mlp, hidden: [8]}, hidden: [4]}\n"
                                       "data: {name: digits}\n")).model.hidden == [4]  # a merge key overrides
    assert not run_dir.exists()


def test_missing_config_file(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope.yaml")


def test_unknown_key_suggests_the_nearest_valid_one():
    message = error_of(base=MLP, overrides=["train.max_step=5"])
    assert "unknown config key 'train.max_step'" in message and "did you mean 'train.max_steps'" in message


def test_unknown_model_key_suggests_a_model_key():
    message = error_of(base=MLP, overrides=["model.hiden=[3]"])
    assert "'model.hiden'" in message and "model.hidden" in message


def test_unknown_top_level_section():
    assert "did you mean 'optimizer'" in error_of(base=MLP, overrides=["optimiser.learning_rate=1"])


def test_wrong_type_names_the_key_and_the_value():
    message = error_of(base=MLP, overrides=["train.max_steps=lots"])
    assert "train.max_steps" in message and "'lots'" in message


def test_wrong_choice_lists_the_choices():
    message = error_of(base=MLP, overrides=["train.nonfinite=ignore"])
    assert "train.nonfinite" in message and "skip" in message and "stop" in message


def test_unknown_model_name_lists_the_registered_models():
    message = error_of(base={**MLP, "model": {"name": "resnet"}})
    assert "resnet" in message and "mlp" in message and "gpt" in message


def test_batch_not_divisible_by_micro_batches():
    message = error_of(base=MLP, overrides=["data.global_batch_size=30", "train.micro_batches=4"])
    assert "data.global_batch_size=30" in message and "train.micro_batches=4" in message


@pytest.mark.parametrize("key", ["log.every_steps", "eval.every_steps", "checkpoint.every_steps"])
def test_steps_per_call_must_divide_every_interval(key):
    aligned = ["log.every_steps=8", "eval.every_steps=8", "checkpoint.every_steps=8"]
    message = error_of(base=MLP, overrides=["train.steps_per_call=4", *aligned, f"{key}=10"])
    assert key in message and "steps_per_call=4" in message and "multiple of 4" in message


def test_config_digest_changes_with_the_config():
    a = load_config(base=MLP)
    b = load_config(base=MLP, overrides=["seed=1"])
    assert a.digest() != b.digest() and a.digest() == load_config(base=MLP).digest()


def test_a_config_without_a_model_section():
    assert "no model section" in error_of(base={"train": {"max_steps": 3}})


def test_sequences_longer_than_the_model_context():
    message = error_of(base={"model": {"name": "gpt", "max_len": 32}, "data": {"seq_len": 64}})
    assert "data.seq_len=64" in message and "32" in message


def test_byte_text_needs_a_byte_vocabulary():
    message = error_of(base={"model": {"name": "gpt", "vocab_size": 100}, "data": {"name": "char_text"}})
    assert "vocab_size" in message and "256" in message
