"""Messages that name the right thing: each is one line, exit status 2, and nothing on disk changes."""

import sys

import pytest

from functrain.commands.cli import main


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("functrain: error: "), lines
    return lines[0]


@pytest.mark.parametrize("name", ["data_dir", "data.npz"])
def test_a_data_path_that_is_a_directory_is_called_one(tmp_path, capsys, name):
    (tmp_path / name).mkdir()
    run_dir = tmp_path / "run"
    assert main(["train", "configs/mlp_digits.yaml", "data.name=array_file", f"data.path={tmp_path / name}",
                 f"run.dir={run_dir}"]) == 2
    line = one_error_line(capsys)
    assert f"data.path='{tmp_path / name}' is a directory, and data.name=array_file reads one file" in line
    assert not run_dir.exists()


def test_a_missing_transformers_names_the_setting_the_config_used(tmp_path, capsys, monkeypatch):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    run_dir = tmp_path / "run"
    assert main(["train", "configs/dpo_char_gpt.yaml", "train.init_from=null", f"data.tokenizer={tmp_path / 'tok'}",
                 f"run.dir={run_dir}"]) == 2
    line = one_error_line(capsys)
    assert "data.tokenizer needs transformers" in line and "--tokenizer" not in line
    assert not run_dir.exists()


def test_a_tokenizer_file_or_an_empty_directory_is_named_as_such(tmp_path, capsys):
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    args = ["generate", str(tmp_path / "no_run"), "--prompt", "The ", "--tokenizer"]
    assert main([*args, str(tmp_path / "tokenizer.json")]) == 2
    assert "is a file; pass the HF tokenizer directory that holds it" in one_error_line(capsys)
    assert main([*args, str(tmp_path / "empty")]) == 2  # not transformers' five lines on sentencepiece and tiktoken
    assert "holds no tokenizer files (tokenizer.json" in one_error_line(capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_converting_a_missing_source_says_it_is_missing(tmp_path, capsys):
    assert main(["convert", "hf-to-functrain", str(tmp_path / "nope"), str(tmp_path / "run")]) == 2
    line = one_error_line(capsys)
    assert f"{tmp_path / 'nope'} does not exist; pass an HF model directory" in line and "config.json not" not in line
    assert not (tmp_path / "run").exists()


def test_reading_a_missing_step_suggests_the_readers_flag_not_a_training_key(tmp_path, capsys):
    for step in (20, 40):  # committed step directories: the step asked for is checked before any is read
        (tmp_path / "run" / "checkpoints" / str(step)).mkdir(parents=True)
    before = sorted(tmp_path.rglob("*"))
    assert main(["generate", str(tmp_path / "run"), "--prompt", "The ", "--step", "7"]) == 2
    line = one_error_line(capsys)
    assert "no checkpoint for step 7" in line and "steps there: 20, 40" in line
    assert "leave --step out for the newest" in line and "checkpoint.resume" not in line
    assert sorted(tmp_path.rglob("*")) == before
