"""Preference runs: exact accumulation over pairs, the LoRA reference (adapters off), TRL's truncation, the
start from another run, kill/resume, and one-line refusals of bad input."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml

from functrain.checkpoint import Checkpointer
from functrain.commands.cli import main
from functrain.tasks.preference.loss import PreferenceSettings, precomputed_reference_logps
from functrain.tasks.reference import REFERENCE
from functrain.core.state import TrainState
from functrain.core.step import StepSettings, make_train_step, trainable_only
from functrain.models import build_model, gpt, llama
from functrain.models.lora import LoraConfig
from functrain.parallel import sharding
from functrain.run.build import build_run
from functrain.config.sections import MeshConfig
from functrain.config.load import load_config
from functrain.run.jax_backend import JaxBackend
from functrain.run.parts import build_parts
from functrain.tasks.preference.task import preference_pieces, preference_program_of
from functrain.tasks.preference.pairs import ByteTokenizer, preference_arrays, tokenize_pair
from tests.commands.test_verify_resume import assert_resumes_as_uninterrupted

PAIRS = [{"prompt": "2+2=", "chosen": "4", "rejected": "five"},
         {"prompt": "The sky is ", "chosen": "blue", "rejected": "green"},
         {"prompt": "a", "chosen": "bc", "rejected": "bd"},
         {"prompt": "hi ", "chosen": "there", "rejected": "you"},
         {"prompt": "1, 2, ", "chosen": "3", "rejected": "7"},
         {"prompt": "cat ", "chosen": "sat", "rejected": "ran"}]
MODEL = {"name": "gpt", "vocab_size": 256, "max_len": 24, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
         "dropout": 0.0}
SEQ_LEN = 20
LN2 = float(np.log(2.0))


def write_pairs(path, pairs=PAIRS):
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    return path


def write_config(tmp_path, pairs=PAIRS, **sections):
    """A tiny DPO config on ``pairs`` (written beside it); ``sections`` update its sections."""
    config = {"seed": 0, "run": {"dir": str(tmp_path / "run")}, "model": dict(MODEL),
              "data": {"name": "preference", "path": str(write_pairs(tmp_path / "pairs.jsonl", pairs)),
                       "seq_len": SEQ_LEN, "global_batch_size": 4, "eval_fraction": 0.0},
              "optimizer": {"name": "adamw", "learning_rate": 1e-2}, "train": {"max_steps": 4},
              "log": {"every_steps": 1, "progress": False, "tensorboard": False},
              "checkpoint": {"every_steps": 2, "async_save": False}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    path = tmp_path / "dpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def batch_of(directory, pairs):
    """A batch of ``pairs`` (byte tokens) with every pair counted once."""
    arrays, _ = preference_arrays(write_pairs(directory / "batch.jsonl", pairs), ByteTokenizer(), SEQ_LEN)
    return {**arrays, "weight": np.ones(len(pairs), np.float32)}


def test_with_lora_the_reference_is_the_base_model_with_adapters_off(tmp_path):
    """LoRA: the reference is the base with the adapters off (no copy); the base never moves; the loss starts
    at ln 2 with no reward accuracy, and a padding row (weight 0) does not count as a pair."""
    batch = batch_of(tmp_path, PAIRS[:4])
    batch["weight"][3] = 0.0
    model = build_model(gpt.GPTConfig(**{k: v for k, v in MODEL.items() if k != "name"}), jnp.float32)
    lora = LoraConfig(rank=2, alpha=4.0, targets=("mlp_in", "mlp_out"))
    program = preference_program_of(model, batch, PreferenceSettings("sigmoid", beta=0.1), lora)
    params, model_state = program.init(jax.random.PRNGKey(0))
    assert REFERENCE not in model_state  # no second copy of the weights
    trainable = program.trainable(params)
    tx = trainable_only(optax.adam(5e-2), trainable)
    state = TrainState.create(params, tx, jax.random.PRNGKey(1), model_state=model_state)
    step = jax.jit(make_train_step(program.loss_fn, tx, stateful=True, trainable=trainable))
    state, first = step(state, batch)
    for _ in range(3):
        state, last = step(state, batch)
    assert float(first["loss"]) == pytest.approx(LN2, abs=1e-6)  # lora_b starts at 0: policy == base
    assert float(first["rewards/accuracies"]) == 0.0 and float(first["weight"]) == 3.0
    assert float(last["rewards/margins"]) > 0 and float(last["loss"]) < LN2
    flat, new = jax.tree.leaves_with_path(params), dict(jax.tree.leaves_with_path(state.params))
    for path, leaf in flat:  # the base (the reference) never moved
        if "lora" not in jax.tree_util.keystr(path):
            np.testing.assert_array_equal(new[path], leaf)


def random_pairs(pairs, vocab, length, seed=0):
    """``pairs`` pairs of random tokens, each completion from a random start to the end."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, vocab, (2 * pairs, length)).astype(np.int32)
    completion = (np.arange(length) >= rng.integers(2, length // 2, (2 * pairs, 1))).astype(np.int8)
    return {"chosen": rows[:pairs], "rejected": rows[pairs:], "chosen_mask": completion[:pairs],
            "rejected_mask": completion[pairs:], "weight": np.ones(pairs, np.float32)}


@pytest.mark.parametrize("reference, micro_batches", [("frozen copy", 1), ("frozen copy", 2), ("lora", 1),
                                                       ("precomputed", 1)])
def test_at_the_first_step_the_policy_is_bitwise_its_own_reference(reference, micro_batches):
    """Equal weights give bitwise equal policy and reference log-probs, on any CPU: the first step's rewards
    are exactly 0 and no pair counts as won, as TRL counts it. The policy's forward is differentiated and the
    reference's is not (or ran before training, precomputed a global batch at a time); on a rotary model their
    compiled code differed in the last bits (XLA fused them differently, and the FMAs rounded differently).
    With micro-batches the precomputed values are not bitwise: the step's forward runs in its accumulation
    loop, which XLA compiles otherwise (see :func:`functrain.tasks.preference.loss.preference_program`)."""
    config = llama.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    batch = random_pairs(64, config.vocab_size, 33)  # before the fix, each case tied at random on this CPU
    lora = LoraConfig(rank=2, alpha=4.0, targets=("q_proj", "k_proj", "up_proj")) if reference == "lora" else None
    model = llama.build(config)
    program = preference_program_of(model, batch, PreferenceSettings("sigmoid", beta=0.1), lora,
                                    precompute_ref=reference == "precomputed")
    mesh = MeshConfig()
    backend = JaxBackend(program, optax.sgd(0.1), None, mesh=sharding.make_mesh(mesh),
                         rules=sharding.logical_rules(mesh), step=StepSettings(micro_batches=micro_batches))
    state = backend.init_state()
    if reference == "precomputed":
        pieces = preference_pieces(model, batch, lora)  # the start hook's forward, compiled on the mesh
        batch = {**batch, **backend.batch_function(precomputed_reference_logps(pieces.apply, pieces.frozen_apply))(
            state, batch)}
    _, first = backend.train_call(state, backend.place(jax.tree.map(lambda x: x[None], batch)))
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert float(first[name][0]) == 0.0, (name, float(first[name][0]))
    assert float(first["loss"][0]) == pytest.approx(LN2, abs=1e-6)


@pytest.mark.parametrize("mode", ["keep_start", "keep_end"])
def test_truncation_cuts_as_trl_collator_does(mode, tmp_path):
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    pairs = [{"prompt": "a long prompt here ", "chosen": "and a long answer", "rejected": "no"},
             {"prompt": "this prompt alone fills it", "chosen": "x", "rejected": "y"}]
    seq_len = 24
    arrays, stats = preference_arrays(write_pairs(tmp_path / "p.jsonl", pairs), ByteTokenizer(), seq_len, mode)
    kept = pairs[:1] if mode == "keep_start" else pairs  # TRL drops a prompt that fills max_length (keep_start)
    assert stats.dropped == ([2] if mode == "keep_start" else [])
    examples = [dict(zip(("prompt_ids", "chosen_ids", "rejected_ids"), tokenize_pair(pair, ByteTokenizer())))
                for pair in kept]
    collated = DataCollatorForPreference(pad_token_id=0, max_length=seq_len, truncation_mode=mode)(examples)
    rows = len(kept)
    for index, key in enumerate(("chosen", "rejected")):
        want_ids = collated["input_ids"][index * rows:(index + 1) * rows].numpy()
        want_mask = collated["completion_mask"][index * rows:(index + 1) * rows].numpy()
        width = want_ids.shape[1]
        np.testing.assert_array_equal(arrays[key][:, :width], want_ids)
        np.testing.assert_array_equal(arrays[f"{key}_mask"][:, :width], want_mask)
        assert not arrays[f"{key}_mask"][:, width:].any()


def test_identical_pairs_warn_once_and_are_counted(tmp_path):
    pairs = PAIRS + [{"prompt": "p", "chosen": "same", "rejected": "same"}] * 2
    data = build_parts(load_config(write_config(tmp_path, pairs))).data
    assert len(data.notes) == 1
    assert "2 pair(s) have identical chosen and rejected" in data.notes[0] and "line 7" in data.notes[0]
    assert len(data.train) == len(pairs)  # kept: they weigh nothing in the margin, not an error


@pytest.mark.parametrize("change, expected", [
    ({"pairs": [{"prompt": "a", "rejected": "b"}]}, "pairs.jsonl line 1 has no 'chosen'"),
    ({"pairs": [{"prompt": "a", "chosen": "", "rejected": "b"}]}, "line 1 has an empty 'chosen' completion"),
    ({"preference": {"beta": 0.0}}, "'preference.beta': Input should be greater than 0"),
    ({"preference": {"loss_type": "kto"}}, "'preference.loss_type': Input should be 'sigmoid', 'ipo'"),
    ({"pairs": [{"prompt": "x" * 30, "chosen": "y", "rejected": "z"}]},
     "more than data.seq_len=20; raise data.seq_len or set preference.truncation_mode"),
    ({"backend": "torch"}, "data.name=preference (DPO and its variants) needs backend: jax"),
    ({"preference": {"init_from": "nowhere"}}, "preference.init_from='nowhere' holds no checkpoints/; train that"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_is_lost(tmp_path, capsys, change, expected):
    sections = {key: value for key, value in change.items() if key not in ("pairs", "backend")}
    path = write_config(tmp_path, change.get("pairs", PAIRS), **sections)
    overrides = [f"backend={change['backend']}"] if "backend" in change else []
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # an earlier run's record
    assert main(["train", str(path), *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("functrain: error:") and expected in err and "\n" not in err, err
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == "{}\n"
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_run_starts_from_another_runs_weights_and_resumes_bitwise(tmp_path):
    """init_from: the policy and the frozen reference start from another run's newest checkpoint; a run so
    started, killed and resumed equals one uninterrupted (verify-resume's check, one subprocess: the SIGKILLed
    run; it resumes from its own checkpoints)."""
    model = build_model(gpt.GPTConfig(**{k: v for k, v in MODEL.items() if k != "name"}), jnp.float32)
    variables = model.init(jax.random.PRNGKey(7), np.zeros((1, 8), np.int32))
    trained = jax.tree.map(np.asarray, nn.meta.unbox(variables["params"]))
    saver = Checkpointer(tmp_path / "sft", keep=None, async_save=False)  # stands in for the SFT run
    saver.save(3, {"params": trained}, {"model": MODEL})
    saver.close()
    dpo = write_config(tmp_path, preference={"init_from": str(tmp_path / "sft")}, train={"steps_per_call": 2},
                       log={"every_steps": 2})
    run = build_run(load_config(dpo))
    start = run.resume.start(run.open_checkpointer(), run.backend, run.sampler)
    for name, tree in (("params", start.state.params), ("reference", start.state.model_state[REFERENCE])):
        assert jax.tree.structure(tree) == jax.tree.structure(trained), name
        for got, want in zip(jax.tree.leaves(tree), jax.tree.leaves(trained)):
            np.testing.assert_array_equal(np.asarray(got), want)
    assert int(start.state.step) == 0 and start.position == 0
    assert_resumes_as_uninterrupted(dpo, tmp_path, 4)
