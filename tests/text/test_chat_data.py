"""Chat jsonl -> tokens with the model's chat template; loss only on assistant answers; bad input named."""

import json
import re
import string

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

import functrain
from functrain.text.chat import chat_dataset, load_chat_tokenizer, pack, tokenize
from functrain.commands.cli import main
from functrain.errors import ConfigError, DataError
from functrain.models import llama
from functrain.core.losses import causal_lm_sums, model_inputs, model_keywords
from tests.torch_bridge.hf.test_hf_finetune import QUIET, tiny_llama_dir

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


# Five conversations of 29-85 tokens: with 128-token records, the first two share a record, the third starts
# the next one (it does not fit after them), and the record boundaries fall between conversations.
PACKED = [*CONVERSATIONS, CONVERSATIONS[1], CONVERSATIONS[0], CONVERSATIONS[1]]


def segments_of(data):
    """(record, start, end) of every conversation in packed data (padding is the trailing pad-token segment)."""
    spans = []
    for row, (segments, tokens) in enumerate(zip(data["segment_ids"], data["tokens"])):
        for segment in np.unique(segments):
            where = np.flatnonzero(segments == segment)
            if not np.all(tokens[where] == 0):  # <pad> is id 0
                spans.append((row, where[0], where[-1] + 1))
    return spans


def test_packed_records_hold_whole_conversations_in_order_with_assistant_only_mask(tmp_path):
    tokenizer = write_tokenizer(tmp_path / "tok")
    data = chat_dataset(str(write_jsonl(tmp_path / "chat.jsonl", PACKED)), str(tmp_path / "tok"), 127,
                        packing=True)
    alone = [tokenize(record["messages"], load_chat_tokenizer(tmp_path / "tok"))[0] for record in PACKED]
    spans = segments_of(data)
    assert [data["tokens"][row, start:end].tolist() for row, start, end in spans] == [a.tolist() for a in alone]
    assert len(data["tokens"]) < len(PACKED) and {row for row, _, _ in spans} == set(range(len(data["tokens"])))
    for row, start, end in spans:  # segments from 1 per record, positions from 0 per conversation
        assert data["positions"][row, start:end].tolist() == list(range(end - start))
    assert data["segment_ids"][:, 0].tolist() == [1] * len(data["tokens"])
    text = lambda ids: "".join(tokenizer.convert_ids_to_tokens(ids.tolist()))  # noqa: E731
    for tokens, mask in zip(data["tokens"], data["mask"]):
        learned = text(tokens[1:][mask == 1])
        assert "assistant" not in learned and "user" not in learned and "<|im_start|>" not in learned
    everything = text(data["tokens"][:, 1:][data["mask"] == 1])
    answers = [m["content"] for record in PACKED for m in record["messages"] if m["role"] == "assistant"]
    assert everything == "".join(f"{answer}<|im_end|>\n" for answer in answers)


def test_each_packed_conversation_has_the_logits_and_loss_it_has_alone(tmp_path):
    write_tokenizer(tmp_path / "tok")
    data = chat_dataset(str(write_jsonl(tmp_path / "chat.jsonl", PACKED)), str(tmp_path / "tok"), 127,
                        packing=True)
    model = llama.build(llama.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    # Each conversation alone, at the start of a row of its own (the padding after it is causally invisible),
    # then the packed records: one batch, so the model runs once with the packing fields and once without.
    spans, (records, length) = segments_of(data), data["tokens"].shape
    alone = {"tokens": np.zeros((len(spans), length), np.int32), "mask": np.zeros((len(spans), length - 1)),
             "segment_ids": np.ones((len(spans), length), np.int32),
             "positions": np.tile(np.arange(length, dtype=np.int32), (len(spans), 1))}
    for i, (row, start, end) in enumerate(spans):
        alone["tokens"][i, :end - start] = data["tokens"][row, start:end]
        alone["mask"][i, :end - start - 1] = data["mask"][row, start:end - 1]
    batch = {k: jnp.concatenate([jnp.asarray(alone[k]), jnp.asarray(data[k])]) for k in alone}
    batch["weight"] = jnp.ones(len(batch["tokens"]))
    with jax.default_matmul_precision("highest"):
        params = model.init(jax.random.PRNGKey(0), model_inputs("causal_lm", batch))["params"]
        logits = model.apply({"params": params}, model_inputs("causal_lm", batch),
                             **model_keywords("causal_lm", batch))
        ignored = model.apply({"params": params}, model_inputs("causal_lm", batch))  # packing fields dropped
    single, packed = logits[:len(spans)], logits[len(spans):]
    np.testing.assert_allclose(ignored[:len(spans)], single, atol=1e-5)  # alone, the fields change nothing
    ignored_differs = []
    for i, (row, start, end) in enumerate(spans):
        stop = min(end, length - 1) - start  # the record's last token is no input
        np.testing.assert_allclose(packed[row, start:start + stop], single[i, :stop], atol=1e-5)
        ignored_differs.append(not np.allclose(ignored[len(spans) + row, start:start + stop], single[i, :stop],
                                               atol=1e-5))
    packed_loss, packed_weight, _ = causal_lm_sums(packed, {k: v[len(spans):] for k, v in batch.items()})
    alone_loss, alone_weight, _ = causal_lm_sums(single, {k: v[:len(spans)] for k, v in batch.items()})
    assert records == 3 and float(packed_weight) == float(alone_weight) > 0
    np.testing.assert_allclose(float(packed_loss), float(alone_loss), rtol=1e-5)
    assert any(ignored_differs)  # a conversation after another in its record sees it without segment_ids


def test_pack_lays_conversations_that_fill_a_record_exactly_without_empty_padding():
    conversation = lambda size: (np.arange(1, size + 1, dtype=np.int32), np.arange(size) % 2 == 1)  # noqa: E731
    data = pack([conversation(4), conversation(4), conversation(3), conversation(2)], seq_len=7, pad_id=0)
    assert data["tokens"].tolist() == [[1, 2, 3, 4, 1, 2, 3, 4], [1, 2, 3, 1, 2, 0, 0, 0]]
    assert data["segment_ids"].tolist() == [[1, 1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 2, 2, 3, 3, 3]]
    assert data["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 2, 0, 1, 0, 1, 2]]
    # Position t learns token t + 1 when it is an answer token of the same conversation (odd offsets here).
    assert data["mask"].tolist() == [[1, 0, 1, 0, 1, 0, 1], [1, 0, 0, 1, 0, 0, 0]]


def test_packing_refuses_a_conversation_longer_than_a_record(tmp_path):
    write_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "chat.jsonl", PACKED)
    with pytest.raises(DataError, match=r"chat\.jsonl: conversation 1 has \d+ tokens, more than "
                                        r"data\.kwargs\.seq_len \+ 1 = 41") as caught:
        chat_dataset(str(path), str(tmp_path / "tok"), 40, packing=True)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("packing", [False, True])
def test_lora_fine_tuning_on_chat_data(tmp_path, packing):
    write_tokenizer(tmp_path / "tok")
    tiny_llama_dir(tmp_path / "hf")  # vocab 256 covers the tokenizer's 104 ids
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    result = functrain.fit(str(tmp_path / "run" / "config.yaml"), **{
        **QUIET, "data.global_batch_size": 2, "train.max_steps": 2, "model.lora": {"rank": 2, "targets": ["q_proj"]},
        "data.target": "functrain.text.chat:chat_dataset",
        "data.kwargs": {"path": str(write_jsonl(tmp_path / "chat.jsonl", PACKED if packing else CONVERSATIONS)),
                        "tokenizer": str(tmp_path / "tok"), "seq_len": 127 if packing else 48,
                        "packing": packing}})
    assert result.step == 2


@pytest.mark.parametrize("line, named", [
    ({"text": "no messages"}, r"chat\.jsonl line 2 has no \"messages\" list"),
    ({"messages": [{"role": "robot", "content": "beep"}]}, r"line 2 has a message with role 'robot'"),
])
def test_bad_chat_lines_are_named(tmp_path, capsys, line, named):
    write_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "chat.jsonl", [CONVERSATIONS[0], line])
    with pytest.raises(DataError, match=named) as caught:
        chat_dataset(str(path), str(tmp_path / "tok"), 32)
    assert "\n" not in str(caught.value)
    _training_on_it_is_one_line_and_keeps_the_run(tmp_path, capsys, path, named)


def _training_on_it_is_one_line_and_keeps_the_run(tmp_path, capsys, chat_path, named: str) -> None:
    """``functrain train`` of a converted model on ``chat_path`` exits 2 with one line matching ``named`` and
    leaves the run directory as it was."""
    tiny_llama_dir(tmp_path / "hf")
    assert main(["convert", "hf-to-functrain", str(tmp_path / "hf"), str(tmp_path / "run")]) == 0
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    capsys.readouterr()  # the conversion's output
    status = main(["train", str(tmp_path / "run" / "config.yaml"), "data.target=functrain.text.chat:chat_dataset",
                   f"data.kwargs={{path: {chat_path}, tokenizer: {tmp_path / 'tok'}, seq_len: 32}}"])
    err = capsys.readouterr().err.strip()
    assert status == 2 and re.search(named, err) and "\n" not in err, err
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_a_tokenizer_without_chat_template_is_one_line_exit_2(tmp_path, capsys):
    write_tokenizer(tmp_path / "tok", chat_template=None)
    with pytest.raises((DataError, ConfigError), match="has no chat template"):
        chat_dataset(str(write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)), str(tmp_path / "tok"), 32)
    _training_on_it_is_one_line_and_keeps_the_run(tmp_path, capsys, tmp_path / "chat.jsonl", "has no chat template")
