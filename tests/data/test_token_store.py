"""``functrain tokenize`` -> token store -> ``data.name: tokens`` windows: the round trip equals tokenizing in
memory, a killed job leaves nothing that loads, and bad input is one line with exit status 2."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, cli_env
from functrain.commands import cli
from functrain.data.token_store import TokenStore
from functrain.data.token_windows import TokenWindows, token_splits
from functrain.errors import DataError
from functrain.text.tokenizer import TextTokenizer, TokenizerSpec
from functrain.commands.tokenize import tokenize_files

PHRASES = ["the quick brown fox", "jumps over", "the lazy dog"]
DOCUMENTS = [f"document {i}: " + " ".join(PHRASES[: 1 + i % 3]) * (i % 5 + 1) for i in range(60)] + ["", "naïve café"]


def _write_inputs(directory):
    """The documents split over a .jsonl, a .parquet and a plain text file (one document)."""
    import pyarrow
    import pyarrow.parquet
    directory.mkdir()
    with open(directory / "a.jsonl", "w") as lines:
        for text in DOCUMENTS[:30]:
            lines.write(json.dumps({"body": text}) + "\n")
    pyarrow.parquet.write_table(pyarrow.table({"body": DOCUMENTS[30:-1]}), directory / "b.parquet")
    (directory / "c.txt").write_text(DOCUMENTS[-1])
    return [str(directory / name) for name in ("a.jsonl", "b.parquet", "c.txt")]


def _bpe_tokenizer(path):
    """A tiny byte-level BPE with an <|endoftext|> special token, trained in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(DOCUMENTS, trainer)
    tokenizer.save(str(path))
    return tokenizer


def _expected_stream(encoded_documents, eos):
    return np.concatenate([np.append(np.asarray(ids, np.int64), eos) for ids in encoded_documents])


def _all_windows(store, seq_len):
    windows = TokenWindows(store, seq_len)
    return windows.gather(np.arange(len(windows)))["tokens"]


def _stream_windows(stream, seq_len):
    count = (len(stream) - 1) // seq_len
    return stream[np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)]


def test_hf_tokenizer_round_trip_through_the_cli_equals_tokenizing_in_memory(tmp_path):
    """Two worker processes, shards of 97 tokens (windows cross shard boundaries): the same stream, index and
    windows as the tokenizer's own batch encoder plus EOS."""
    inputs = _write_inputs(tmp_path / "in")
    tokenizer = _bpe_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-m", "functrain", "tokenize", *inputs, str(out), "--tokenizer",
                           str(tmp_path / "tokenizer.json"), "--workers", "2", "--field", "body",
                           "--shard-tokens", "97"],
                          cwd=REPO_ROOT, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(DOCUMENTS)} documents" in proc.stdout

    eos = tokenizer.token_to_id("<|endoftext|>")
    encoded = [encoding.ids for encoding in tokenizer.encode_batch(DOCUMENTS)]
    stream = _expected_stream(encoded, eos)
    store = TokenStore.open(out)
    assert store.manifest["tokenizer"]["eos_id"] == eos and store.vocab_size == tokenizer.get_vocab_size()
    assert store.manifest["dtype"] == "uint16" and len(store.shards) == -(-len(stream) // 97)
    assert np.array_equal(store.doc_starts, np.concatenate([[0], np.cumsum([len(ids) + 1 for ids in encoded])]))
    assert np.array_equal(_all_windows(store, 16), _stream_windows(stream, 16))


def test_byte_fallback_round_trip_equals_utf8_bytes(tmp_path):
    inputs = _write_inputs(tmp_path / "in")
    manifest = tokenize_files(inputs, str(tmp_path / "store"), workers=1, field="body", shard_tokens=50)
    stream = _expected_stream([list(text.encode("utf-8")) for text in DOCUMENTS], 0)
    store = TokenStore.open(tmp_path / "store")
    assert manifest["num_tokens"] == len(stream) and manifest["tokenizer"]["name"] == "bytes"
    assert np.array_equal(_all_windows(store, 7), _stream_windows(stream, 7))
    assert TextTokenizer(TokenizerSpec()).vocab_size == store.vocab_size == 256


def test_eval_split_is_whole_documents_at_the_end(tmp_path):
    tokenize_files(_write_inputs(tmp_path / "in"), str(tmp_path / "store"), workers=1, field="body")
    store = TokenStore.open(tmp_path / "store")
    train, evaluation = token_splits(str(tmp_path / "store"), 8, False, 0.25, 256)
    assert train.stop == evaluation.first and evaluation.first in set(store.doc_starts.tolist())
    assert abs(evaluation.first - 0.75 * store.num_tokens) < np.max(np.diff(store.doc_starts))
    last = train.gather(np.array([len(train) - 1]))["tokens"]
    assert last.shape == (1, 9) and (len(train) - 1) * 8 + 9 <= train.stop


def test_a_killed_tokenize_leaves_no_store_that_loads(tmp_path):
    """The input is a pipe that this test feeds slowly: the job is mid-way (its temporary directory holds a
    partial shard) when it is SIGKILLed, with its workers."""
    fifo = tmp_path / "slow.jsonl"
    os.mkfifo(fifo)
    out = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "functrain", "tokenize", str(fifo), str(out), "--workers", "2"],
                            cwd=REPO_ROOT, env=cli_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with open(fifo, "w") as feed:
            for _ in range(3):  # three batches of documents, then the job waits for more
                feed.write("".join(json.dumps({"text": f"line {i} " * 50}) + "\n" for i in range(512)))
                feed.flush()
            deadline = time.monotonic() + 60
            while not any(path.stat().st_size for path in tmp_path.glob("store.tmp-*/tokens-*.bin")):
                assert time.monotonic() < deadline and proc.poll() is None, "tokenize never wrote a shard"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not out.exists()
    (partial,) = tmp_path.glob("store.tmp-*")
    with pytest.raises(DataError, match="has no manifest.json"):
        TokenStore.open(partial)


# --------------------------------------------------------------------------------------------- bad input

@pytest.fixture
def byte_store(tmp_path):
    tokenize_files([str(path) for path in _write_documents(tmp_path / "in")], str(tmp_path / "store"), workers=1)
    return tmp_path / "store"


def _write_documents(directory):
    directory.mkdir()
    paths = [directory / f"doc{i}.txt" for i in range(len(DOCUMENTS))]
    for path, text in zip(paths, DOCUMENTS):
        path.write_text(text * 4)
    return paths


def _snapshot(directory):
    return {path.name: (path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(directory.rglob("*"))}


def _one_error_line(capsys, argv) -> str:
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0]
    return lines[0]


def _train_argv(tmp_path, store, *overrides):
    return ["train", str(REPO_ROOT / "configs/gpt_tokens.yaml"), f"data.path={store}", f"run.dir={tmp_path / 'run'}",
            "model.d_model=16", "model.n_layers=1", "model.n_heads=2", "model.d_ff=32", *overrides]


@pytest.mark.parametrize("damage, expected", [
    (lambda store: (store / "manifest.json").unlink(), "has no manifest.json"),
    (lambda store: os.truncate(store / "tokens-00000.bin", 100), "tokens-00000.bin has 100 bytes, the manifest says"),
])
def test_a_damaged_store_is_one_line_naming_the_file(tmp_path, capsys, byte_store, damage, expected):
    damage(byte_store)
    before = _snapshot(byte_store)
    message = _one_error_line(capsys, _train_argv(tmp_path, byte_store))
    assert expected in message and "rerun functrain tokenize" in message
    assert _snapshot(byte_store) == before and not (tmp_path / "run").exists()


def test_token_ids_beyond_the_model_vocab_are_refused_at_build(tmp_path, capsys, byte_store):
    before = _snapshot(byte_store)
    message = _one_error_line(capsys, _train_argv(tmp_path, byte_store, "model.vocab_size=100"))
    assert f"data.path='{byte_store}'" in message and "set model.vocab_size to at least 256" in message
    assert not (tmp_path / "run").exists() and _snapshot(byte_store) == before


def test_seq_len_beyond_the_model_context_is_refused(tmp_path, capsys, byte_store):
    before = _snapshot(byte_store)
    message = _one_error_line(capsys, _train_argv(tmp_path, byte_store, "data.seq_len=256"))
    assert "data.seq_len=256" in message and "context of 128" in message
    assert not (tmp_path / "run").exists() and _snapshot(byte_store) == before


def test_a_tokenizer_file_that_does_not_load(tmp_path, capsys):
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 3}')
    (tmp_path / "in.txt").write_text("some text")
    message = _one_error_line(capsys, ["tokenize", str(tmp_path / "in.txt"), str(tmp_path / "store"),
                                       "--tokenizer", str(tmp_path / "bad.json")])
    assert f"tokenizer file '{tmp_path / 'bad.json'}' does not load" in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bad.json", "in.txt"]


def test_an_existing_output_is_never_overwritten(tmp_path, capsys, byte_store):
    before = _snapshot(byte_store)
    message = _one_error_line(capsys, ["tokenize", str(tmp_path / "in" / "doc0.txt"), str(byte_store)])
    assert "already exists" in message and _snapshot(byte_store) == before


def test_a_bad_json_line_names_the_line_and_leaves_nothing(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "fine"}\n\n{"txt": "no text field"}\n')
    message = _one_error_line(capsys, ["tokenize", str(tmp_path / "in.jsonl"), str(tmp_path / "store"),
                                       "--workers", "1"])
    assert f"{tmp_path / 'in.jsonl'}:3 has no string field 'text'" in message and "--field" in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.jsonl"]


def test_packing_needs_a_token_store(tmp_path, capsys):
    message = _one_error_line(capsys, ["train", str(REPO_ROOT / "configs/char_gpt.yaml"), "data.packing=true",
                                       f"run.dir={tmp_path / 'run'}"])
    assert "data.packing=true needs data.name=tokens" in message and not (tmp_path / "run").exists()


def test_a_token_store_is_a_data_sources_entry(byte_store):
    from functrain.config.load import load_config
    from functrain.data.datasets import open_source
    config = load_config(REPO_ROOT / "configs/gpt_tokens.yaml", ["data.eval_fraction=0.2"])
    train, evaluation = open_source(str(byte_store), None, config.data, 256)
    assert isinstance(train, TokenWindows) and train.packing and len(evaluation) > 0
    assert set(train.gather(np.arange(2))) == {"tokens", "segment_ids", "positions"}


def test_tokenizing_empty_files_writes_nothing(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    proc = subprocess.run([sys.executable, "-m", "functrain", "tokenize", str(tmp_path / "empty.txt"),
                           str(tmp_path / "store")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "are empty" in proc.stderr, proc.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty.txt"]
