"""``train.matmul_precision``: the precision a run's products are traced at, resolved per platform, carried by the
compiled train call and by the sampler of a task's experience stage (GRPO's rollouts), so that both round alike."""

import json

import numpy as np
import pytest

import functrain
from functrain.core.precision import matmul_precision
from tests.config.test_config import error_of

MLP = {"model": {"name": "mlp", "hidden": [16]}, "data": {"name": "digits", "global_batch_size": 16, "prefetch": 0},
       "train": {"max_steps": 2}, "log": {"progress": False}}


@pytest.mark.parametrize("setting, compute, platform, expected", [
    ("auto", "float32", "gpu", "highest"),  # XLA's default would round the operands to TF32
    ("auto", "float32", "tpu", "highest"),  # ... or to one bfloat16 pass
    ("auto", "float32", "cpu", None),  # XLA:CPU multiplies float32 in float32 anyway
    ("auto", "bfloat16", "gpu", None),
    ("default", "float32", "gpu", None),
    ("high", "bfloat16", "cpu", "high"),
    ("highest", "float32", "cpu", "highest"),
])
def test_auto_is_highest_for_float32_on_an_accelerator_and_a_named_precision_is_taken_as_it_is(
        setting, compute, platform, expected):
    assert matmul_precision(setting, compute, platform) == expected


def _train_call_text(tmp_path, **overrides) -> str:
    run = functrain.build(MLP, **{"run.dir": str(tmp_path / "r"), **overrides})
    host = run.loader.host_batch(0)[0]
    batches = {name: np.stack([value] * run.config.train.steps_per_call) for name, value in host.items()}
    return run.backend.compile_train_call(run.backend.init_state(), batches).as_text()


def test_the_compiled_train_call_carries_the_configured_precision(tmp_path):
    assert "operand_precision={highest,highest}" in _train_call_text(tmp_path, **{"train.matmul_precision": "highest"})
    assert "operand_precision" not in _train_call_text(tmp_path)  # auto on a CPU: XLA's default


def test_grpos_sampler_traces_its_products_at_the_steps_precision(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": word}) + "\n" for word in ["The ", "A ", "To ", "If "]))
    rewards = tmp_path / "precision_rewards.py"
    rewards.write_text("def ones(completions, **columns):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = {"model.name": "gpt", "model.vocab_size": 256, "model.max_len": 16, "model.d_model": 16,
                "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32, "data.name": "prompts",
                "data.path": str(prompts), "data.seq_len": 16, "data.global_batch_size": 4, "grpo.num_generations": 2,
                "grpo.max_completion_length": 4, "grpo.reward_funcs": ["precision_rewards:ones"],
                "train.max_steps": 1, "log.progress": False}

    def scoring_text(precision: str) -> str:
        run = functrain.build({}, **settings, **{"run.dir": str(tmp_path / precision),
                                                 "train.matmul_precision": precision})
        params = run.backend.init_state().params
        forward = run.backend.experience.sampler.programs(run.backend.mesh)[1]
        return forward.lower(params, np.zeros((4, 8), np.int32)).as_text()

    assert "precision = [HIGHEST, HIGHEST]" in scoring_text("highest")
    assert "HIGHEST" not in scoring_text("default")


def test_an_unknown_precision_lists_the_choices():
    message = error_of(base=MLP, overrides=["train.matmul_precision=fp32"])
    assert "train.matmul_precision" in message and "highest" in message and "\n" not in message
