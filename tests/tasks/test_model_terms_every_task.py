"""Every registered task trains a mixture of experts with the model's own terms: the balancing losses in its loss and
gradient, the ``moe/`` metrics logged, global-batch balancing exact over micro-batches, and DeepSeek-V3's bias
update after every step. Tasks get them from the one assembly path (functrain.core.program.task_program), never
by remembering them: a task added later is held to the same by ``TASK_RUNS`` below."""

import json
import textwrap

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from functrain import fit
from functrain.checkpoint import load_params
from functrain.tasks import task_names
from tests.tasks.distill.test_distill_run import write_teacher

AUX, Z = 0.1, 0.01
MIXTRAL = {"name": "mixtral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32, "num_local_experts": 4,
           "num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": AUX,
           "router_z_loss_coef": Z, "load_balance_scope": "global_batch"}
DEEPSEEK = {"name": "deepseek_v3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
            "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12,
            "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "first_k_dense_replace": 0, "max_position_embeddings": 32, "bias_update_rate": 0.01,
            "initializer_range": 0.2, "router_z_loss_coef": Z}
TEACHER = {"name": "gpt", "vocab_size": 256, "max_len": 32, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32,
           "dropout": 0.0}
WORDS = ["The ", "A list ", "To ", "If the ", "When ", "This ", "It ", "In "]
# Tasks that train something other than a causal LM (an MoE family is one): not run here, with the reason.
NOT_LANGUAGE_MODELS = {"classify": "trains a classifier; every MoE family is a causal LM"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Pairs, prompts with a reward module, and a teacher checkpoint, shared by the runs below."""
    root = tmp_path_factory.mktemp("terms")
    pairs = [{"prompt": word, "chosen": "the end.", "rejected": "no, it is not"} for word in WORDS]
    (root / "pairs.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": word}) + "\n" for word in WORDS))
    (root / "terms_test_rewards.py").write_text(textwrap.dedent('''
        def no_e(completions, **columns):
            return [float("e" not in text) + len(text) / 10 for text in completions]
    '''))
    write_teacher(root / "teacher", TEACHER)
    with pytest.MonkeyPatch.context() as patch:  # the reward module importable
        patch.syspath_prepend(str(root))
        yield root


def task_config(task, root):
    """The task's section and data for a tiny run (the model comes from the test)."""
    # No evaluation split: these runs check the train step's loss, metrics and state (an end-of-run evaluation of the
    # bundled text at this sequence length is 486 batches).
    text = {"data": {"name": "char_text", "seq_len": 12, "global_batch_size": 8, "eval_fraction": 0}}
    return {
        "causal_lm": {"task": "causal_lm", **text},
        "distill": {"task": "distill", **text, "distill": {"teacher": str(root / "teacher"), "alpha": 0.5}},
        "preference": {"task": "preference", "data": {"name": "preference", "path": str(root / "pairs.jsonl"),
                                                      "seq_len": 24, "global_batch_size": 8, "eval_fraction": 0}},
        "grpo": {"task": "grpo", "data": {"name": "prompts", "path": str(root / "prompts.jsonl"), "seq_len": 16,
                                          "global_batch_size": 4},
                 "grpo": {"num_generations": 4, "max_completion_length": 4, "beta": 0.04,
                          "reward_funcs": ["terms_test_rewards:no_e"]}},
    }[task]


TASK_RUNS = ("causal_lm", "distill", "preference", "grpo")


def test_every_registered_task_is_run_here():
    assert set(task_names()) == set(TASK_RUNS) | set(NOT_LANGUAGE_MODELS)


def first_step(root, name, task, model, micro_batches=1):
    """One step of ``task`` on ``model``: its metrics.jsonl line and its run directory."""
    run_dir = root / name
    config = {**task_config(task, root), "seed": 0, "run": {"dir": str(run_dir)}, "model": model,
              "optimizer": {"name": "adamw", "learning_rate": 0.01},
              "train": {"max_steps": 1, "micro_batches": micro_batches},
              "checkpoint": {"async_save": False}, "eval": {"every_steps": 0},
              "log": {"every_steps": 1, "progress": False, "tensorboard": False, "plot": False}}
    fit(config)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(line for line in lines if line["split"] == "train" and line["step"] == 1), run_dir


@pytest.mark.parametrize("task", TASK_RUNS)
def test_the_balancing_terms_are_in_every_tasks_loss_and_exact_over_micro_batches(workspace, task):
    whole, _ = first_step(workspace, f"{task}_whole", task, MIXTRAL)
    split, _ = first_step(workspace, f"{task}_split", task, MIXTRAL, micro_batches=4)
    plain, _ = first_step(workspace, f"{task}_plain", task, {**MIXTRAL, "router_aux_loss_coef": 0.0,
                                                              "router_z_loss_coef": 0.0})
    assert {"moe/aux_loss", "moe/z_loss", "moe/load_max_over_mean/layer_0", "moe/load_entropy/layer_0"} <= set(whole)
    # In the loss: the terms' coefficients times the logged terms, over the same task loss.
    assert whole["loss"] - plain["loss"] == pytest.approx(AUX * whole["moe/aux_loss"] + Z * whole["moe/z_loss"],
                                                          rel=1e-4, abs=1e-6)
    assert whole["moe/aux_loss"] > 0.5  # top-2 of 4 experts: about 1 (perfect balance), never 0
    # ... and in its gradient.
    assert whole["grad_norm"] != pytest.approx(plain["grad_norm"], rel=1e-6)
    # Global-batch balancing: four micro-batches give the one-batch loss and terms.
    for name in ("loss", "moe/aux_loss", "moe/z_loss"):
        assert split[name] == pytest.approx(whole[name], rel=1e-6, abs=1e-6), name


@pytest.mark.parametrize("task", TASK_RUNS)
def test_deepseek_v3s_bias_update_runs_under_every_task(workspace, task):
    metrics, run_dir = first_step(workspace, f"{task}_deepseek", task, DEEPSEEK)
    assert "moe/z_loss" in metrics
    biases = [leaf for path, leaf in flatten_dict(load_params(run_dir)).items()
              if path[-1] == "e_score_correction_bias"]
    assert len(biases) == 1  # the one (MoE) layer
    # One step of +-0.01 from zero (0 where an expert's load was the mean): moved by the counts, not left at zero.
    assert np.abs(np.asarray(biases[0])).max() == pytest.approx(0.01)
