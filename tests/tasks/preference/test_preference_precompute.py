"""preference.precompute_ref: the reference's log-probs computed once before the first step, saved beside the
run, carried by the batches; the same training as with the frozen copy, one params copy less in the state, a
resume that reads the file back, and a file that does not fit the data refused in one line."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functrain
from functrain.commands.cli import main
from functrain.tasks.reference import REFERENCE
from functrain.tasks.preference.loss import (REFERENCE_LOGPS, PreferenceSettings,
                                             precomputed_reference_logps)
from functrain.models import build_model, gpt
from functrain.models.lora import LoraConfig
from functrain.tasks.preference.task import preference_pieces, preference_program_of
from functrain.tasks.preference.reference import FILE_NAME
from tests.tasks.preference.test_preference import MODEL, PAIRS, batch_of, write_config, write_pairs

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")
# 8 pairs: 6 train (shuffled batches of 4, the last one wrapping into the next epoch), 2 eval.
EIGHT = PAIRS + [{"prompt": "dog ", "chosen": "ran", "rejected": "flew"},
                 {"prompt": "up ", "chosen": "down", "rejected": "up"}]


# Two programs compute the same values (the frozen copy's forward inside the step, the precomputed file's outside
# it), each rounding in float32 its own way: the log-probs are sums near -28, whose last bit is 2e-6.
def same_in_float32(expected: float):
    return pytest.approx(expected, rel=1e-6, abs=1e-6)


def train_metrics(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {line["step"]: line for line in lines if line.get("split") == "train"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps with the frozen copy, and with precomputed log-probs in two legs (2 steps, then a
    resume to 4), with the file's bytes and mtime as the first leg left them."""
    root = tmp_path_factory.mktemp("precompute")
    # SGD: compiles faster than AdamW, and the comparison does not depend on the optimizer.
    sections = {"data": {"eval_fraction": 0.25}, "eval": {"every_steps": 2},
                "optimizer": {"name": "sgd", "learning_rate": 0.5}}
    frozen_dir, precomputed_dir = root / "frozen", root / "precomputed"
    frozen_dir.mkdir()
    precomputed_dir.mkdir()
    frozen = functrain.fit(str(write_config(frozen_dir, EIGHT, **sections)))
    config = write_config(precomputed_dir, EIGHT, preference={"precompute_ref": True}, **sections)
    first = functrain.fit(str(config), **{"train.max_steps": 2})
    saved = precomputed_dir / "run" / FILE_NAME
    before = saved.read_bytes(), saved.stat().st_mtime_ns
    resumed = functrain.fit(str(config))
    again = functrain.fit(str(config), **{"run.dir": str(precomputed_dir / "again")})  # uninterrupted
    return {"frozen": frozen, "first": first, "resumed": resumed, "again": again, "file": saved, "before": before,
            "config": config}


def test_precomputed_log_probs_train_as_the_frozen_copy_does(runs):
    """Every step's loss, rewards and log-probs equal the frozen copy's (fp32), the eval's too: the batches
    carry each pair's own values, whatever the shuffled order and across the resume."""
    frozen, precomputed = train_metrics(runs["frozen"].run_dir), train_metrics(runs["resumed"].run_dir)
    assert sorted(precomputed) == sorted(frozen) == [1, 2, 3, 4]
    assert frozen[1]["loss"] == pytest.approx(np.log(2.0), abs=1e-6)
    for step in frozen:
        for name in METRICS:
            assert precomputed[step][name] == same_in_float32(frozen[step][name]), (step, name)
    for name in METRICS:
        assert runs["resumed"].metrics["eval"][name] == same_in_float32(runs["frozen"].metrics["eval"][name]), name


def test_the_state_holds_no_reference_copy(runs):
    """The frozen copy is one params copy in the model state; precomputed runs hold none."""
    frozen, precomputed = runs["frozen"].state, runs["resumed"].state
    assert REFERENCE in frozen.model_state and REFERENCE not in precomputed.model_state
    size = lambda tree: sum(leaf.size for leaf in jax.tree.leaves(tree))  # noqa: E731
    assert size(frozen) - size(precomputed) == size(frozen.params) > 0


def test_the_file_is_saved_and_a_resume_reads_it_back(runs):
    """The values of every train and eval pair and what identifies them; the resumed leg did not rewrite it,
    and its final weights equal an uninterrupted run's, whose own file holds the same values and digests."""
    with np.load(runs["file"]) as saved:
        assert int(saved["train_pairs"]) == 6 and int(saved["eval_pairs"]) == 2
        assert all(saved[f"{split}_{name}"].shape == (pairs,) for split, pairs in (("train", 6), ("eval", 2))
                   for name in REFERENCE_LOGPS)
        assert np.all(saved["train_ref_chosen_logps"] < 0) and len(str(saved["weights_digest"])) == 64
    assert runs["file"].read_bytes() == runs["before"][0]
    assert runs["file"].stat().st_mtime_ns == runs["before"][1]
    assert runs["first"].step == 2 and runs["resumed"].step == 4
    for got, want in zip(jax.tree.leaves(runs["resumed"].state.params), jax.tree.leaves(runs["again"].state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with np.load(runs["file"]) as saved, np.load(runs["again"].run_dir / FILE_NAME) as again:
        assert sorted(saved.files) == sorted(again.files)
        for key in saved.files:
            np.testing.assert_array_equal(saved[key], again[key])


@pytest.mark.parametrize("case", ["pairs changed", "file missing", "other weights"])
def test_a_file_that_does_not_fit_is_one_line_and_kept(runs, tmp_path, capsys, case):
    """A resumed run whose pairs changed or whose file is gone, a fresh run whose file came from other
    weights: one line naming the file and the fix, exit 2, every file left as it was."""
    args, run_dir = ["train", str(runs["config"]), "train.max_steps=6"], runs["file"].parent
    if case == "pairs changed":  # the same number of pairs, in another order
        args.append(f"data.path={write_pairs(tmp_path / 'changed.jsonl', EIGHT[::-1])}")
        expected = (f"{run_dir / FILE_NAME} does not fit this run: the tokenised pairs differ (data.path or its "
                    f"tokenisation changed); point data.path at the pairs this run started with")
    elif case == "file missing":
        run_dir = tmp_path / "run"
        shutil.copytree(runs["file"].parent / "checkpoints", run_dir / "checkpoints")
        expected = f"{run_dir / FILE_NAME} is missing: the run resumes from checkpoint 4"
    else:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        with np.load(runs["file"]) as saved:
            np.savez(run_dir / FILE_NAME, **{**{key: saved[key] for key in saved.files},
                                             "weights_digest": np.asarray("0" * 64)})
        expected = (f"{run_dir / FILE_NAME} does not fit this run: it was computed from other starting weights; "
                    f"delete {run_dir / FILE_NAME} to compute them again")
    files = lambda: {path: path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}  # noqa: E731
    before = files()
    assert main([*args, f"run.dir={run_dir}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and expected in err, err
    assert files() == before


def test_reference_free_losses_refuse_it(tmp_path, capsys):
    path = write_config(tmp_path, preference={"precompute_ref": True, "loss_type": "simpo"})
    assert main(["train", str(path)]) == 2
    assert "loss_type=simpo uses no reference; remove preference.precompute_ref" in capsys.readouterr().err


def test_with_lora_the_precomputed_reference_is_the_base_with_adapters_off(tmp_path):
    """LoRA: the values come from the base (adapters off) even when the adapters already move the policy
    (a run started from trained adapters): the same eval sums as the in-step base reference."""
    batch = batch_of(tmp_path, PAIRS[:4])
    model = build_model(gpt.GPTConfig(**{k: v for k, v in MODEL.items() if k != "name"}), jnp.float32)
    lora = LoraConfig(rank=2, alpha=4.0, targets=("mlp_in", "mlp_out"))
    settings = PreferenceSettings("ipo", beta=0.1)  # ipo also reads the token counts
    in_step = preference_program_of(model, batch, settings, lora)
    precomputed = preference_program_of(model, batch, settings, lora, precompute_ref=True)
    pieces = preference_pieces(model, batch, lora)
    precompute = precomputed_reference_logps(pieces.apply, pieces.frozen_apply)
    rng = np.random.default_rng(0)  # random weights, adapters included (cheaper than compiling init)
    params, model_state = jax.tree.map(lambda leaf: (0.2 * rng.standard_normal(leaf.shape)).astype(leaf.dtype),
                                       jax.eval_shape(in_step.init, jax.random.PRNGKey(0)))

    @jax.jit
    def both(params, model_state, batch, key):
        carried = {**batch, **precompute(params, model_state, batch)}
        return (in_step.eval_loss_fn(params, model_state, batch, key),
                precomputed.eval_loss_fn(params, model_state, carried, key))
    want, got = both(params, model_state, batch, jax.random.PRNGKey(0))
    assert float(got[0]) == pytest.approx(float(want[0]), abs=1e-6) and float(got[1]) == 4.0
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen"):
        assert float(got[2][name]) == same_in_float32(float(want[2][name])), name
    assert abs(float(got[2]["rewards/margins"])) > 1e-4  # the policy moved away from its reference
