"""``functrain generate RUN_DIR --prompt TEXT``: continue a prompt with a language-model run."""

import argparse

HELP = "continue a prompt with a language-model run"
DEFAULT_NEW_TOKENS = 200


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir")
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"default {DEFAULT_NEW_TOKENS}, or what the model's context leaves after the prompt",
    )
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: UTF-8 bytes)")


def run(args: argparse.Namespace) -> int:
    from functrain.text.decode import (
        Sampling,
        encode_prompt,
        fitting_new_tokens,
        load_language_model,
        load_tokenizer,
        sample_text,
    )

    Sampling(args.max_new_tokens or 1, args.temperature, args.top_k, args.seed)  # bad flags before any loading
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    model, params, _ = load_language_model(args.run_dir, args.step)
    new_tokens = args.max_new_tokens
    if new_tokens is None:  # the default fits the model: as many as its context leaves after the prompt
        prompt_tokens = len(encode_prompt(args.prompt, model.config.vocab_size, tokenizer))
        new_tokens = max(fitting_new_tokens(prompt_tokens, model.config, DEFAULT_NEW_TOKENS), 1)
    sampling = Sampling(new_tokens, args.temperature, args.top_k, args.seed)
    print(args.prompt + sample_text(model, params, args.prompt, sampling, tokenizer))
    return 0
