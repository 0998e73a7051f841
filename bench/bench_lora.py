"""Benchmark: LoRA fine-tuning vs full fine-tuning of the same Llama-shaped model, in the same run.

Both use the pieces `functrain train` uses (the model's Program, ``make_train_step`` with AdamW, jitted with
the state donated); LoRA puts rank-``r`` adapters on every projection (q, k, v, o, gate, up, down), the common
recipe. Reports steps/s of each (interleaved repeats, median of the paired ratios; wall clock, and CPU time of
the process, which other jobs on a shared machine disturb less) and the optimizer-state bytes of each.

    python bench/bench_lora.py [--layers 2] [--hidden 512] [--batch 4] [--steps 4] [--repeats 3]
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

from functrain.models.lora import LoraConfig, lora_program  # noqa: E402
from functrain.models import llama  # noqa: E402
from functrain.core.program import as_program  # noqa: E402
from functrain.core.state import TrainState  # noqa: E402
from functrain.core.step import make_train_step, trainable_only  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(program, trainable, batch):
    tx = optax.adamw(1e-4)
    if trainable is not None:
        tx = trainable_only(tx, trainable)
    step = make_train_step(program.loss_fn, tx, stateful=True, trainable=trainable)
    params, model_state = program.init(jax.random.PRNGKey(0))
    state = TrainState.create(params, tx, jax.random.PRNGKey(1), model_state=model_state)
    return jax.jit(step, donate_argnums=0), state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    config = llama.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                               num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                               num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq + 1)
    tokens = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"tokens": tokens, "weight": np.ones(args.batch, np.float32)}
    module = llama.build(config)
    full_program = as_program(module, batch, kind="causal_lm")
    lora_prog = lora_program(module, batch, "causal_lm", LoraConfig(rank=args.rank, targets=TARGETS))
    full_step, full_state = build(full_program, None, batch)
    lora_params = jax.eval_shape(lora_prog.init, jax.random.PRNGKey(0))[0]
    lora_step, lora_state = build(lora_prog, lora_prog.trainable(lora_params), batch)

    def state_bytes(state):
        return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state.opt_state))

    params = sum(leaf.size for leaf in jax.tree.leaves(full_state.params))
    print(f"Llama-shaped: {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, {params:,} params; "
          f"batch {args.batch} x {args.seq} tokens, LoRA rank {args.rank} on {', '.join(TARGETS)}; "
          f"{jax.devices()[0].platform}")
    full_flops, lora_flops = compiled_flops(full_step, full_state, batch), compiled_flops(lora_step, lora_state, batch)
    print(f"XLA FLOPs per step: full {full_flops / 1e9:.2f} G, LoRA {lora_flops / 1e9:.2f} G "
          f"(full / LoRA {full_flops / lora_flops:.2f}x)")
    full_bytes, lora_bytes = state_bytes(full_state), state_bytes(lora_state)
    print(f"optimizer state: full {full_bytes / 2**20:.2f} MiB, LoRA {lora_bytes / 2**20:.3f} MiB "
          f"({100 * lora_bytes / full_bytes:.2f}% of full; target <= 5%)")
    ratios, cpu_ratios, full_rates, lora_rates = [], [], [], []
    for _ in range(args.repeats):
        full_time, full_cpu_time, full_state = timed(full_step, full_state, batch, args.steps)
        lora_time, lora_cpu_time, lora_state = timed(lora_step, lora_state, batch, args.steps)
        full_rate, full_cpu, lora_rate, lora_cpu = (1 / t for t in (full_time, full_cpu_time, lora_time, lora_cpu_time))
        full_rates.append(full_rate)
        lora_rates.append(lora_rate)
        ratios.append(lora_rate / full_rate)
        cpu_ratios.append(lora_cpu / full_cpu)
        print(f"  full {full_rate:7.2f} steps/s   LoRA {lora_rate:7.2f} steps/s   ratio {lora_rate / full_rate:.2f}x"
              f"   (per CPU second: {lora_cpu / full_cpu:.2f}x)")
    print(f"LoRA / full steps/s: median of paired ratios {statistics.median(ratios):.2f}x wall, "
          f"{statistics.median(cpu_ratios):.2f}x per CPU second (best/best wall "
          f"{max(lora_rates) / max(full_rates):.2f}x; target >= 1.3x)")


if __name__ == "__main__":
    main()
