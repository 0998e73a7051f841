"""Benchmark: a DPO step against an SFT step of the same model on the same tokens, in the same run.

SFT trains the causal-LM loss on the ``2B`` sequences (the chosen and the rejected rows of ``B`` pairs); DPO
trains the sigmoid preference loss on the same rows as ``B`` pairs, with the frozen reference (a copy of the
starting weights in the model state) run in the same compiled step, outside the gradient. A forward costs
about a third of a forward + backward; the reference adds one forward, and the policy's forward is
rematerialised (its backward runs it again, so that it compiles as the reference's does and equal weights give
bitwise equal log-probs): DPO / SFT step time near 5/3, not 2 (a second model trained). With
``preference.precompute_ref`` (``DPO pre``) the batch carries the reference's log-probs, computed once before
training: no reference forward, so about 4/3 (and no copy of the weights in the state). All use the pieces `functrain train`
uses (the Program, ``make_train_step`` with AdamW, jitted with the state donated). Reports XLA's FLOPs of each
compiled step and steps/s (interleaved repeats, median of the paired ratios; wall clock, and CPU time of the
process, which other jobs on a shared machine disturb less).

    python bench/bench_dpo.py [--layers 2] [--hidden 512] [--pairs 4] [--seq 128] [--steps 4] [--repeats 3]
"""

import argparse
import statistics
import sys
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import compiled_flops, timed  # noqa: E402

from functrain.tasks.preference.loss import (  # noqa: E402
    REFERENCE_LOGPS,
    PreferenceSettings,
    precomputed_reference_logps,
    preference_program,
)
from functrain.core.program import as_program  # noqa: E402
from functrain.core.adapters import model_pieces  # noqa: E402
from functrain.core.state import TrainState  # noqa: E402
from functrain.core.step import make_train_step  # noqa: E402
from functrain.models import llama  # noqa: E402


def build(program, batch):
    tx = optax.adamw(1e-4)
    step = make_train_step(program.loss_fn, tx, stateful=True)

    def create(key):
        params, model_state = program.init(key)
        return TrainState.create(params, tx, jax.random.PRNGKey(1), model_state=model_state)
    # Created under jit, as the backend creates it: the reference copy gets buffers of its own.
    state = jax.jit(create)(jax.random.PRNGKey(0))
    return jax.jit(step, donate_argnums=0), state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = llama.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq + 1)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, args.vocab, (2 * args.pairs, args.seq + 1)).astype(np.int32)
    completion = np.zeros_like(rows, np.int8)
    completion[:, args.seq // 2:] = 1  # the second half of each sequence is its completion
    pairs = {"chosen": rows[:args.pairs], "rejected": rows[args.pairs:], "chosen_mask": completion[:args.pairs],
             "rejected_mask": completion[args.pairs:], "weight": np.ones(args.pairs, np.float32)}
    sft = {"tokens": rows, "weight": np.ones(2 * args.pairs, np.float32)}
    module = llama.build(config)
    pieces = model_pieces(module, rows[:, :-1], pairs)
    dpo_step, dpo_state = build(preference_program(pieces, PreferenceSettings("sigmoid")), pairs)
    sft_step, sft_state = build(as_program(module, sft, kind="causal_lm"), sft)
    precomputed = preference_program(pieces, PreferenceSettings("sigmoid"), precompute_reference=True)
    pre_pairs = {**pairs, **{name: np.zeros(args.pairs, np.float32) for name in REFERENCE_LOGPS}}
    pre_step, pre_state = build(precomputed, pre_pairs)
    pre_pairs.update(jax.jit(precomputed_reference_logps(pieces.apply))(pre_state.params, pre_state.model_state, pairs))

    params = sum(leaf.size for leaf in jax.tree.leaves(sft_state.params))
    print(f"Llama-shaped: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {params:,} params; "
          f"{args.pairs} pairs = {2 * args.pairs} x {args.seq} tokens per step; {jax.devices()[0].device_kind}")
    sft_flops, dpo_flops = compiled_flops(sft_step, sft_state, sft), compiled_flops(dpo_step, dpo_state, pairs)
    pre_flops = compiled_flops(pre_step, pre_state, pre_pairs)
    print(f"XLA FLOPs per step: SFT {sft_flops / 1e9:.2f} G, DPO {dpo_flops / 1e9:.2f} G "
          f"(DPO / SFT {dpo_flops / sft_flops:.2f}x; two more forwards ~1.67x), DPO pre {pre_flops / 1e9:.2f} G "
          f"({pre_flops / sft_flops:.2f}x)")
    ratios, cpu_ratios, pre_ratios = [], [], []
    for _ in range(args.repeats):
        sft_time, sft_cpu, sft_state = timed(sft_step, sft_state, sft, args.steps)
        dpo_time, dpo_cpu, dpo_state = timed(dpo_step, dpo_state, pairs, args.steps)
        pre_time, _, pre_state = timed(pre_step, pre_state, pre_pairs, args.steps)
        ratios.append(dpo_time / sft_time)
        cpu_ratios.append(dpo_cpu / sft_cpu)
        pre_ratios.append(pre_time / sft_time)
        print(f"  SFT {1e3 * sft_time:8.2f} ms/step   DPO {1e3 * dpo_time:8.2f} ms/step   ratio "
              f"{dpo_time / sft_time:.2f}x   (CPU time: {dpo_cpu / sft_cpu:.2f}x)   DPO pre {1e3 * pre_time:8.2f} "
              f"ms/step ({pre_time / sft_time:.2f}x)")
    print(f"DPO / SFT step time: median of paired ratios {statistics.median(ratios):.2f}x wall, "
          f"{statistics.median(cpu_ratios):.2f}x CPU time (two more forwards: ~1.67x); DPO pre / SFT "
          f"{statistics.median(pre_ratios):.2f}x wall")


if __name__ == "__main__":
    main()
