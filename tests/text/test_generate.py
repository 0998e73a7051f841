"""Generation: the KV cache gives the same tokens as recomputing the sequence, converted HF models continue a
prompt exactly as transformers' greedy ``generate`` does, and the CLI refuses bad prompts in one line."""

import flax.linen as nn
import jax
import numpy as np
import pytest
import torch

from functrain.commands.cli import main
from functrain.text.decode import Generator, Sampling, load_language_model
from functrain.models import build_model
from functrain.models.gpt import GPTConfig
from tests.commands.test_cli import snapshot
from tests.torch_bridge.hf.test_hf_convert import build_hf_model
from torch_bridge.hf import hf_to_run_dir

PROMPT = np.array([[5, 17, 42, 8, 3], [60, 2, 9, 33, 71]])


def tiny_gpt():
    """A GPT whose context (34) holds exactly the 5-token prompt and 30 new tokens (the last is never fed)."""
    model = build_model(GPTConfig(max_len=34, d_model=32, n_layers=2, n_heads=4, d_ff=64))
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(1), np.zeros((1, 8), np.int32))["params"])
    return model, params


@pytest.mark.parametrize("sampling", [Sampling(30), Sampling(30, temperature=0.8, top_k=20, seed=4)],
                         ids=["greedy", "top_k"])
def test_kv_cache_generates_the_tokens_of_full_recomputation(sampling):
    model, params = tiny_gpt()
    generator = Generator(model)
    cached = generator(params, PROMPT, sampling)
    uncached = generator(params, PROMPT, sampling, use_cache=False)
    assert cached.shape == (2, 30)
    np.testing.assert_array_equal(cached, uncached)
    if sampling.temperature:  # another seed draws another sample
        assert (generator(params, PROMPT, Sampling(30, 0.8, 20, seed=5)) != cached).any()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_converted_hf_model_generates_what_transformers_generates(arch, tmp_path):
    hf_model = build_hf_model(arch, {})
    hf_model.generation_config.eos_token_id = None  # run the full length, as functrain does
    hf_model.generation_config.pad_token_id = 0
    hf_model.save_pretrained(tmp_path / "hf")
    hf_to_run_dir(str(tmp_path / "hf"), str(tmp_path / "run"))
    model, params, step = load_language_model(tmp_path / "run")
    assert step == 0
    new_tokens = 28  # prompt + new tokens - 1 == n_positions: the whole context
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor(PROMPT), max_new_tokens=new_tokens, do_sample=False)
    expected = expected.numpy()[:, PROMPT.shape[1]:]
    generator = Generator(model)
    got = generator(params, PROMPT, Sampling(new_tokens))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(generator(params, PROMPT, Sampling(new_tokens), use_cache=False), expected)


def test_generate_cli_prints_a_continuation_and_refuses_bad_prompts(tmp_path, capsys):
    build_hf_model("gpt2", {}).save_pretrained(tmp_path / "hf")  # vocabulary of 96 ids, 32 positions
    run_dir = tmp_path / "run"
    hf_to_run_dir(str(tmp_path / "hf"), str(run_dir))
    assert main(["generate", str(run_dir), "--prompt", "AB", "--max-new-tokens", "5", "--top-k", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("AB") and len(printed.rstrip("\n").encode("utf-8", "replace")) >= 2

    before = snapshot(run_dir)
    bad = {("--prompt", "caf\u00e9"): "outside the model's vocabulary of 96 ids",
           ("--prompt", "A", "--step", "7"): "no checkpoint for step 7",
           ("--prompt", "A", "--max-new-tokens", "40"): "exceeds the model's context of 32 positions",
           ("--prompt", "A", "--top-k", "0"): "--top-k 0 must be at least 1",
           ("--prompt", "A", "--top-k", "-5"): "--top-k -5 must be at least 1",
           ("--prompt", "A", "--temperature", "-1"): "--temperature -1.0 must be 0 (greedy) or more",
           ("--prompt", "A", "--max-new-tokens", "0"): "--max-new-tokens 0 must be at least 1"}
    for args, message in bad.items():
        assert main(["generate", str(run_dir), *args]) == 2
        assert message in capsys.readouterr().err
    assert snapshot(run_dir) == before

    # Without --max-new-tokens the default (200) is capped to what the 32-position context leaves.
    assert main(["generate", str(run_dir), "--prompt", "AB", "--temperature", "0"]) == 0
    continuation = capsys.readouterr().out.rstrip("\n")[2:]
    assert 0 < len(continuation.encode("utf-8", "replace")) <= 3 * 31


def test_ragged_sampling_draws_the_same_tokens_whatever_block_of_noise_is_drawn_at_once(monkeypatch):
    """generate_ragged draws the Gumbel noise of several positions at once (decode.NOISE_BLOCK_BYTES): one position
    at a time (each position's key, as jax.random.categorical draws) and four (the last block cut short) give the
    same tokens and log-probs."""
    from functrain.text import decode

    model, params = tiny_gpt()
    prompts, lengths = np.pad(PROMPT, ((0, 0), (0, 1))), np.array([5, 6], np.int32)  # ragged: a prompt token forced
    row_bytes = len(PROMPT) * 256 * 4  # one position's noise: rows x vocabulary x float32
    drawn = []
    for block in (1, 4):  # 27 positions drawn: the last block of four holds three
        monkeypatch.setattr(decode, "NOISE_BLOCK_BYTES", block * row_bytes)
        sample = jax.jit(lambda p, x, n, k: decode.generate_ragged(model, p, x, n, k, prefill=5, max_new_tokens=26,
                                                                    temperature=0.8, top_k=20))  # fmt: skip
        drawn.append(jax.device_get(sample(params, prompts, lengths, jax.random.PRNGKey(4))))
    (tokens, logps), (block_tokens, block_logps) = drawn
    np.testing.assert_array_equal(block_tokens, tokens)
    np.testing.assert_array_equal(block_logps, logps)
    assert len(np.unique(tokens)) > 5  # sampled, not one token repeated


def test_rows_repeating_a_prompt_share_its_prefill_and_draw_what_separate_prefills_draw():
    """generate_ragged's ``repeats``: rows in runs of copies of one prompt (GRPO's groups) run the prefill once per
    run; the tokens drawn are the same as with a prefill per row, their log-probs equal within float32 rounding."""
    from functrain.text import decode

    model, params = tiny_gpt()
    prompts = np.repeat(np.pad(PROMPT, ((0, 0), (0, 1))), 3, axis=0)  # two prompts, three rows each
    lengths = np.repeat(np.array([5, 6], np.int32), 3)  # the second one's last token forced after the prefill
    sample = jax.jit(
        lambda p, x, n, k, repeats: decode.generate_ragged(
            model, p, x, n, k, prefill=5, max_new_tokens=12, temperature=1.0, top_k=None, repeats=repeats
        ),
        static_argnames="repeats",
    )
    (tokens, logps), (shared_tokens, shared_logps) = (
        jax.device_get(sample(params, prompts, lengths, jax.random.PRNGKey(3), repeats)) for repeats in (1, 3)
    )
    np.testing.assert_array_equal(shared_tokens, tokens)
    np.testing.assert_allclose(shared_logps, logps, rtol=1e-6, atol=1e-6)
    assert (tokens[0] != tokens[1]).any()  # each row draws its own completion
