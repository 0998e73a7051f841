"""Chat jsonl -> tokens with the model's chat template; loss only on assistant answers; bad input named."""

import json
import string

import pytest
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

import functrain
from functrain.chat import chat_dataset
from functrain.cli import main
from functrain.errors import ConfigError, DataError
from test_hf_finetune import QUIET, tiny_llama_dir

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": "name?"}, {"role": "assistant", "content": "tiny"}]},
]


def write_tokenizer(directory, chat_template=CHATML):
    """A character-level fast tokenizer with ChatML special tokens (no download)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "<|im_start|>", "<|im_end|>",
                                                 *string.printable])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                                     additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    if chat_template:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    return tokenizer


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_mask_covers_exactly_the_assistant_answers(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok")
    data = chat_dataset(str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)), str(tmp_path / "tok"), 96)
    assert data["tokens"].shape == (2, 97) and data["mask"].shape == (2, 96)
    for tokens, mask in zip(data["tokens"], data["mask"]):
        targets = tokens[1:]
        text = lambda ids: "".join(tokenizer.convert_ids_to_tokens(ids.tolist()))  # noqa: E731
        learned = text(targets[mask == 1])
        skipped = text(targets[(mask == 0) & (targets != tokenizer.pad_token_id)])
        answers = [m["content"] for m in CONVERSATIONS[0 if "hello" in learned else 1]["messages"]
                   if m["role"] == "assistant"]
        assert learned == "".join(f"{answer}<|im_end|>\n" for answer in answers)
        assert "assistant" in skipped and "hello" not in skipped  # headers and prompts carry no loss


def test_lora_fine_tuning_on_chat_data(tmp_path):
    write_tokenizer(tmp_path / "tok")
    tiny_llama_dir(tmp_path / "hf")  # vocab 256 covers the tokenizer's 104 ids
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    result = functrain.fit(str(tmp_path / "run" / "config.yaml"), **{
        **QUIET, "data.global_batch_size": 2, "train.max_steps": 2, "model.lora": {"rank": 2, "targets": ["q_proj"]},
        "data.target": "functrain.chat:chat_dataset",
        "data.kwargs": {"path": str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)),
                        "tokenizer": str(tmp_path / "tok"), "seq_len": 48}})
    assert result.step == 2


@pytest.mark.parametrize("line, named", [
    ({"text": "no messages"}, r"chat\.jsonl line 2 has no \"messages\" list"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, r"line 2 has a message with role 'robot'"),
])
def test_bad_chat_lines_are_named(tmp_path, line, named):
    write_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "chat.jsonl", [CONVERSATIONS[0], line])
    with pytest.raises(DataError, match=named) as caught:
        chat_dataset(str(path), str(tmp_path / "tok"), 32)
    assert "\n" not in str(caught.value)


def test_a_tokenizer_without_chat_template_is_one_line_exit_2(tmp_path, capsys):
    write_tokenizer(tmp_path / "tok", chat_template=None)
    with pytest.raises((DataError, ConfigError), match="has no chat template"):
        chat_dataset(str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)), str(tmp_path / "tok"), 32)
    tiny_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    capsys.readouterr()  # the conversion's output
    status = main(["train", str(tmp_path / "run" / "config.yaml"), "data.target=functrain.chat:chat_dataset",
                   f"data.kwargs={{path: {tmp_path / 'chat.jsonl'}, tokenizer: {tmp_path / 'tok'}, seq_len: 32}}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "has no chat template" in err and "\n" not in err, err
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before
