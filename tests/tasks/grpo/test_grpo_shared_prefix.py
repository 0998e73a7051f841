"""A group's prompt prefix run once in the GRPO step (``grpo.share_prompt``, functrain/tasks/shared_prefix.py): the
loss, its metrics and its gradient equal the plain forward's (float32), also split into micro-batches and with the
reference's KL, for attention variants (grouped-query heads and scanned layers, GPT's learned positions, soft-capped
scores under a sliding window narrower than the prefix); and it is used exactly where the step's forward is the
plain model's."""

import jax
import numpy as np
import pytest

from functrain.core.adapters import model_pieces
from functrain.config.load import load_config
from functrain.core.step import split_micro_batches
from functrain.models import build_model, model_config_class
from functrain.tasks.grpo.loss import LossSettings, grpo_program
from functrain.tasks.grpo.task import shared_prefix_forward
from functrain.tasks.shared_prefix import SharedPrefix, SharedPrefixForward

VOCAB, GENERATIONS, LENGTH = 64, 4, 12
PROMPT_LENGTHS = (5, 3)  # two groups: the shorter prompt is the shared prefix
FAMILIES = {
    "llama": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, scan_layers=True),
    "gpt": dict(vocab_size=VOCAB, max_len=16, d_model=32, n_layers=1, n_heads=2, d_ff=48),
    "gemma2": dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, max_position_embeddings=16,
                   sliding_window=2),
}


def grpo_batch() -> dict[str, np.ndarray]:
    """Two prompts, four completions each (of several lengths, right padded), as the experience stage lays them."""
    rng = np.random.default_rng(0)
    rows = len(PROMPT_LENGTHS) * GENERATIONS
    tokens = rng.integers(1, VOCAB, (rows, LENGTH)).astype(np.int32)
    mask = np.zeros((rows, LENGTH), np.int32)
    for group, prompt_length in enumerate(PROMPT_LENGTHS):
        prompt = rng.integers(1, VOCAB, prompt_length)
        for row in range(group * GENERATIONS, (group + 1) * GENERATIONS):
            end = LENGTH - row % 3
            tokens[row, :prompt_length] = prompt
            tokens[row, end:] = 0
            mask[row, prompt_length:end] = 1
    return {"tokens": tokens, "completion_mask": mask, "advantages": rng.normal(size=rows).astype(np.float32),
            "batch_rows": np.full(rows, rows, np.float32), "batch_tokens": np.full(rows, mask[:, 1:].sum(), np.float32),
            "sampler_logps": np.where(mask[:, 1:] > 0, -3.0, np.nan).astype(np.float32),
            "host_metrics": np.zeros((rows, 0), np.float32)}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_shared_prefix_gives_the_plain_forwards_loss_metrics_and_gradient(family):
    batch = grpo_batch()
    model_config = model_config_class(family).model_validate({"name": family, **FAMILIES[family]})
    pieces = model_pieces(build_model(model_config), batch["tokens"][:, :-1], batch)
    settings = LossSettings(loss_type="grpo", beta=0.04)  # the reference's log-probs through the prefix too
    prefix = min(PROMPT_LENGTHS)
    programs = [
        grpo_program(pieces, settings, ()),
        grpo_program(pieces, settings, (), SharedPrefixForward(model_config, np.float32, SharedPrefix(4, prefix))),
        grpo_program(pieces, settings, (), SharedPrefixForward(model_config, np.float32, SharedPrefix(2, prefix))),
    ]

    # One compiled program (run eagerly, the init and the scaling compiled each of their ops: a third of the test).
    @jax.jit
    def init(rng):
        params, model_state = programs[0].init(rng)
        # The policy off its reference: the KL and its gradient not 0.
        return jax.tree.map(lambda p: p * 1.01, params), model_state

    params, model_state = init(jax.random.PRNGKey(0))

    @jax.jit
    def all_three(params):  # one compile
        def loss(params, program, batch):
            loss_sum, _, aux, _ = program.loss_fn(params, model_state, batch, jax.random.PRNGKey(1))
            return loss_sum, aux

        whole = [jax.value_and_grad(loss, has_aux=True)(params, program, batch) for program in programs[:2]]
        # Two micro-batches (rows m, m + 2, ...: two of a group's rows in each), summed as the step sums them.
        # A loop over the two (the forward traced and compiled once, not twice).
        parts = jax.lax.map(
            lambda half: jax.value_and_grad(loss, has_aux=True)(params, programs[2], half),
            split_micro_batches(batch, 2),
        )
        return [*whole, jax.tree.map(lambda both: both[0] + both[1], parts)]

    (plain, plain_aux), plain_grads = all_three(params)[0]
    for split, ((value, aux), grads) in enumerate(all_three(params)[1:]):
        assert float(value) == pytest.approx(float(plain), rel=1e-6) and float(aux["kl"]) > 0
        for name in ("entropy", "kl", "clip_ratio/region_mean"):
            np.testing.assert_allclose(aux[name], plain_aux[name], rtol=1e-5, atol=1e-7)
        # The gap reads the same positions (with micro-batches it is the sum of their largest: not compared).
        if not split:
            np.testing.assert_allclose(aux["rollout/logprob_gap"], plain_aux["rollout/logprob_gap"], rtol=1e-5)
        for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(plain_grads), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("overrides, shared_rows", [
    ({}, 4),
    ({"train.micro_batches": 2}, 2),  # each micro-batch holds two of a group's rows
    ({"train.micro_batches": 8}, None),  # one row of a group per micro-batch: nothing to share
    ({"train.micro_batches": 3, "data.global_batch_size": 12, "grpo.num_generations": 6}, 2),
    ({"model.remat": "full"}, None),  # the sampling model keeps no remat: the memory setting wins
    ({"model.lora": {"rank": 2}, "model.scan_layers": False}, None),  # adapters: the reference is the base, run by the plain forward
    ({"grpo.share_prompt": False}, None),
    ({"model.name": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
      "model.moe_intermediate_size": 16}, None),  # router statistics count every token
])  # fmt: skip
def test_the_prefix_is_shared_where_the_step_forward_is_the_plain_models(overrides, shared_rows):
    from functrain.tasks.grpo.config import GRPOConfig

    model = {"name": "llama", **FAMILIES["llama"]}
    for key in [key for key in overrides if key.startswith("model.")]:
        model[key.removeprefix("model.")] = overrides.pop(key)
    base = {"task": "grpo", "model": model, "data": {"name": "prompts", "path": "prompts.jsonl", "seq_len": 16,
            "global_batch_size": 8}, "grpo": {"num_generations": 4, "max_completion_length": 6}}  # fmt: skip
    config = load_config(None, [f"{key}={value}" for key, value in overrides.items()], base=base)
    section = config.section("grpo")
    assert isinstance(section, GRPOConfig)
    batch = grpo_batch()
    pieces = model_pieces(build_model(config.model), batch["tokens"][:, :-1], batch)
    if config.model.lora is not None:
        from functrain.models.lora import lora_transform

        pieces = lora_transform(pieces, config.model.lora)

    class Prompts:
        shortest = 3

    shared = shared_prefix_forward(config, section, pieces, Prompts(), batch)  # type: ignore[arg-type]
    assert (None if shared is None else shared.prefix) == (
        None if shared_rows is None else SharedPrefix(shared_rows, 3)
    )
