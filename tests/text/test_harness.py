"""lm-evaluation-harness: the ``functrain`` model scores and generates as lm-eval's own ``hf`` model does on the
exported checkpoint, ``eval.harness_tasks`` logs the scores during training, ``functrain eval`` writes lm-eval's results
object, and bad input is one line with exit status 2."""

import json
import math
import string

import numpy as np
import pytest
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

import functrain
from tests.conftest import REPO_ROOT
from functrain.checkpoint import load_params_and_meta
from functrain.commands.cli import main
from functrain.errors import ConfigError
from tests.commands.test_cli import snapshot
from tests.torch_bridge.hf.test_hf_convert import build_hf_model
from torch_bridge.hf import hf_to_run_dir, run_dir_to_hf

TASKS_DIR = REPO_ROOT / "examples" / "lm_eval_tasks"
TASKS = ["functrain_choice", "functrain_perplexity", "functrain_generate"]
# Metrics compared to lm-eval's hf model: log-likelihood based (relative 1e-4) and generated (exact).
LIKELIHOOD_METRICS = {"functrain_choice": ("acc,none", "acc_norm,none"),
                      "functrain_perplexity": ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none")}


@pytest.fixture(autouse=True, scope="module")
def at_repo_root():
    """The bundled task YAMLs name their JSONL files relative to the repository root (lm-eval's rule)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO_ROOT)
        yield


def write_char_tokenizer(directory):
    """A character-level fast tokenizer with BOS/EOS (no download)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *string.printable])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                                     bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(directory)
    return len(vocab)


def evaluate(model, model_args, batch_size, limit=None):
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size,
                                   task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
                                   log_samples=True, limit=limit, device="cpu", bootstrap_iters=0)


def test_scores_and_generations_match_lm_eval_hf_model_on_the_exported_checkpoint(tmp_path):
    import functrain.text.harness  # noqa: F401 (registers "functrain" with lm-eval)
    vocab = write_char_tokenizer(tmp_path / "tok")
    # A 48-token context: the rolling windows overlap and the long contexts are cut from the left.
    hf_to_run_dir_source = build_hf_model("llama", dict(vocab_size=vocab, max_position_embeddings=48, bos_token_id=1,
                                                        eos_token_id=2, pad_token_id=0))
    hf_to_run_dir_source.save_pretrained(tmp_path / "hf")
    hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    run_dir_to_hf(str(tmp_path / "run"), str(tmp_path / "export"), None)

    ours = evaluate("functrain", f"run={tmp_path / 'run'},tokenizer={tmp_path / 'tok'}", batch_size=4, limit=4)
    theirs = evaluate("hf", f"pretrained={tmp_path / 'export'},tokenizer={tmp_path / 'tok'},dtype=float32",
                      batch_size=1, limit=4)
    for task, metrics in LIKELIHOOD_METRICS.items():
        for metric in metrics:
            assert math.isclose(ours["results"][task][metric], theirs["results"][task][metric], rel_tol=1e-4), \
                (task, metric)
        for mine, reference in zip(ours["samples"][task], theirs["samples"][task], strict=True):
            np.testing.assert_allclose(np.array(mine["filtered_resps"], float)[..., 0],
                                       np.array(reference["filtered_resps"], float)[..., 0], rtol=1e-5)
    generated = [sample["filtered_resps"] for sample in ours["samples"]["functrain_generate"]]
    assert generated == [sample["filtered_resps"] for sample in theirs["samples"]["functrain_generate"]]
    assert any(text != [""] for text in generated)  # the comparison is not between empty strings
    assert ours["results"]["functrain_generate"]["exact_match,none"] == \
        theirs["results"]["functrain_generate"]["exact_match,none"]


GPT_RUN = {"model": {"name": "gpt", "vocab_size": 256, "max_len": 64, "d_model": 32, "n_layers": 1, "n_heads": 2,
                     "d_ff": 64, "dropout": 0.0},
           # No eval data: the harness alone evaluates, and keep-best reads its score.
           "data": {"name": "char_text", "seq_len": 32, "global_batch_size": 8, "eval_fraction": 0.0},
           "train": {"max_steps": 2}, "log": {"every_steps": 1, "progress": False, "tensorboard": False,
                                              "plot": True},
           "checkpoint": {"async_save": False, "keep_best": 1, "best_metric": "harness/functrain_choice/acc",
                          "best_mode": "max"},
           "eval": {"every_steps": 2, "max_batches": 1,
                    "harness_tasks": TASKS, "harness_include_path": str(TASKS_DIR), "harness_limit": 2,
                    "harness_batch_size": 4}}


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A byte-level GPT trained 2 steps with the bundled tasks scored at its evaluation (eval.harness_tasks)."""
    run_dir = tmp_path_factory.mktemp("harness") / "gpt"
    functrain.fit({**GPT_RUN, "run": {"dir": str(run_dir)}})
    return run_dir


def test_eval_harness_logs_finite_scores_of_every_task_during_training(gpt_run):
    records = [json.loads(line) for line in (gpt_run / "metrics.jsonl").read_text().splitlines()]
    harness = [record for record in records if record["split"] == "harness"]
    assert [record["step"] for record in harness] == [2]
    scores = {key: value for key, value in harness[0].items() if key not in ("step", "split")}
    assert {"functrain_choice/acc", "functrain_choice/acc_norm", "functrain_perplexity/word_perplexity",
            "functrain_perplexity/bits_per_byte", "functrain_generate/exact_match"} <= set(scores)
    assert all(math.isfinite(value) for value in scores.values())
    assert not [record for record in records if record["split"] == "eval"]
    _, meta = load_params_and_meta(gpt_run)
    assert meta["best_metric"]["value"] == scores["functrain_choice/acc"]
    assert (gpt_run / "plot.png").is_file()


def test_eval_command_writes_lm_eval_results_equal_to_the_training_scores(gpt_run, tmp_path, capsys):
    out = tmp_path / "results.json"
    assert main(["eval", str(gpt_run), "--tasks", ",".join(TASKS), "--include-path", str(TASKS_DIR), "--limit", "2",
                 "--batch-size", "4", "--output", str(out), "--log-samples"]) == 0
    assert "functrain_choice" in capsys.readouterr().out  # lm-eval's table
    written = json.loads(out.read_text())
    assert set(written["configs"]) == set(TASKS) and written["config"]["model"] == "functrain"
    assert all(len(written["samples"][task]) == 2 for task in TASKS)
    logged = next(json.loads(line) for line in (gpt_run / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["split"] == "harness")
    for task, metric in (("functrain_choice", "acc"), ("functrain_perplexity", "word_perplexity"),
                         ("functrain_perplexity", "bits_per_byte"), ("functrain_generate", "exact_match")):
        assert math.isclose(written["results"][task][f"{metric},none"], logged[f"{task}/{metric}"], rel_tol=1e-5)


def test_bad_eval_input_is_one_line_exit_2_and_keeps_the_run(gpt_run, tmp_path, capsys):
    mlp_dir = tmp_path / "mlp"
    functrain.fit("configs/mlp_digits.yaml", **{"run.dir": str(mlp_dir), "train.max_steps": 1, "log.progress": False,
                                               "log.tensorboard": False, "eval.every_steps": 0,
                                               "checkpoint.async_save": False})
    (tmp_path / "empty").mkdir()
    before = snapshot(gpt_run)
    capsys.readouterr()  # what training printed (and earlier commands' log handlers, whose streams are gone)
    bad = {(str(gpt_run), "--tasks", "functrain_choise", "--include-path", str(TASKS_DIR)):
           "lm-eval task 'functrain_choise' does not exist; did you mean 'functrain_choice'?",
           (str(mlp_dir), "--tasks", "functrain_choice"): "is not a language model",
           (str(tmp_path / "empty"), "--tasks", "functrain_choice"): "is not a functrain checkpoint",
           (str(gpt_run), "--tasks", "functrain_choice", "--step", "7"): "no checkpoint for step 7"}
    for args, message in bad.items():
        assert main(["eval", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert snapshot(gpt_run) == before
    with pytest.raises(ConfigError, match="eval.harness_tasks: lm-eval task 'no_such_task' does not exist"):
        functrain.fit({**GPT_RUN, "run": {"dir": str(tmp_path / "never")},
                       "eval": {"harness_tasks": ["no_such_task"], "harness_include_path": str(TASKS_DIR)}})
    assert not (tmp_path / "never").exists()
