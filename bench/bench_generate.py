"""Generation with the KV cache against recomputing the whole sequence for every token (issue 13).

The char GPT of ``configs/char_gpt.yaml`` (d_model 128, 2 layers, 4 heads) with ``max_len`` raised to 1024 so
a 512-token sample fits; weights are random (speed does not depend on them). Both paths are jitted and
compiled before timing; the baseline keeps one fixed-size buffer, so it too compiles once. Prints tokens/s of
each and the ratio. Target: >= 10x at 512 new tokens.

    python bench/bench_generate.py [--new-tokens 512] [--repeats 3]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from functrain.config.load import load_config  # noqa: E402
from functrain.text.decode import Generator, Sampling  # noqa: E402
from functrain.models import build_model  # noqa: E402


def best_seconds(run, repeats: int) -> float:
    run()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = load_config("configs/char_gpt.yaml", ["model.max_len=1024"])
    model = build_model(config.model)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"])
    prompt = np.frombuffer(b"The file", np.uint8).astype(np.int32)[None]
    sampling = Sampling(args.new_tokens, temperature=0.8, top_k=40)
    generator = Generator(model)
    seconds = {cached: best_seconds(lambda: generator(params, prompt, sampling, use_cache=cached), args.repeats)
               for cached in (True, False)}
    rates = {cached: args.new_tokens / s for cached, s in seconds.items()}
    print(f"{jax.devices()[0].platform}: {args.new_tokens} new tokens after an 8-token prompt, batch 1")
    print(f"  KV cache       {rates[True]:10.1f} tokens/s")
    print(f"  no cache       {rates[False]:10.1f} tokens/s (whole sequence recomputed per token)")
    print(f"  ratio          {rates[True] / rates[False]:10.1f}x (target >= 10x)")


if __name__ == "__main__":
    main()
