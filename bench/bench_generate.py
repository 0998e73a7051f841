"""Generation with the KV cache against recomputing the whole sequence for every token (issue 13).

The char GPT of ``configs/char_gpt.yaml`` (d_model 128, 2 layers, 4 heads) with ``max_len`` raised to 1024 so
a 512-token sample fits; weights are random (speed does not depend on them). Both paths are jitted and
compiled before timing; the baseline keeps one fixed-size buffer, so it too compiles once. Prints tokens/s of
each and the ratio. Target: >= 10x at 512 new tokens.

``--grpo-sampler`` instead times the bundled GRPO example's sampling (``configs/grpo_char_gpt.yaml``: 8 prompts of
its file x 8 completions of 24 tokens, temperature 1, the run's ``Sampler`` on a one-device mesh, random weights)
with the dense sampler and the paged one (``grpo.sampler: paged``, issue 48), alternating ``--repeats`` times, and
prints each one's median CPU and wall-clock seconds, the median of the paired CPU-time ratios (paged / dense;
target <= 0.6) and whether both drew the same tokens.

    python bench/bench_generate.py [--new-tokens 512] [--repeats 3]
    python bench/bench_generate.py --grpo-sampler [--repeats 20] [--page-size 11] [--decode-slots N]
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


def grpo_sampling(args: argparse.Namespace) -> None:
    """The bundled GRPO example's sampling, dense and paged (see the module docstring)."""
    import json
    import statistics

    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from functrain.tasks.grpo.paging import paging_of
    from functrain.tasks.grpo.prompts import read_prompts
    from functrain.tasks.grpo.rollout import draw
    from functrain.tasks.sampling import Sampler

    config = load_config("configs/grpo_char_gpt.yaml", [])
    section = config.section("grpo")
    if args.page_size or args.decode_slots:
        section = section.model_copy(update={"page_size": args.page_size, "decode_slots": args.decode_slots})
    prompts = read_prompts(config.data.path, None)
    model = build_model(config.model)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"])
    params = jax.device_put(params, NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), PartitionSpec()))
    paging = paging_of(section.model_copy(update={"sampler": "paged"}), prompts, episodes=False)
    samplers = {
        name: Sampler(config.model, None, "float32", max_new_tokens=section.max_completion_length,
                      temperature=section.temperature, paging=paging if name == "paged" else None)
        for name in ("dense", "paged")
    }  # fmt: skip
    groups = config.data.global_batch_size // section.num_generations
    indices = np.arange(groups)
    drawn = {}

    def run(name: str, key: int) -> tuple[float, float]:
        cpu, wall = time.process_time(), time.perf_counter()
        completions = draw(samplers[name], params, prompts, indices, jax.random.PRNGKey(key),
                           section.num_generations, section.max_completion_length)  # fmt: skip
        drawn[name] = [ids.tolist() for ids in completions.ids]
        return time.process_time() - cpu, time.perf_counter() - wall

    seconds = {name: [] for name in samplers}
    for repeat in range(args.repeats + 1):  # the first: compilation
        for name in samplers:
            seconds[name].append(run(name, repeat))
        assert drawn["dense"] == drawn["paged"], "the paged sampler drew other tokens"
    pairs = [paged[0] / dense[0] for dense, paged in zip(seconds["dense"][1:], seconds["paged"][1:])]
    lengths = [len(ids) for ids in drawn["paged"]]
    print(f"{jax.devices()[0].platform}: the bundled GRPO example's sampling, {groups} prompts x "
          f"{section.num_generations} completions of <= {section.max_completion_length} tokens "
          f"(mean {statistics.mean(lengths):.1f}), page size {paging.page_size}, slots {paging.slots or 'all'}")  # fmt: skip
    for name, times in seconds.items():
        cpu, wall = (statistics.median(time[index] for time in times[1:]) for index in (0, 1))
        print(f"  {name:6s} {cpu * 1e3:8.1f} ms CPU  {wall * 1e3:8.1f} ms wall (medians of {args.repeats})")
    print(f"  paged / dense CPU time: {statistics.median(pairs):.3f} (median of the paired ratios; target <= 0.6)")
    print(f"  same tokens: {drawn['dense'] == drawn['paged']} ({json.dumps(drawn['paged'][0][:8])}...)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-sampler", action="store_true")
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--decode-slots", type=int, default=None)
    args = parser.parse_args()
    if args.grpo_sampler:
        return grpo_sampling(args)
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
