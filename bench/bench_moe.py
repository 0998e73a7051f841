"""Benchmark: the MoE layer's grouped dispatch (tokens sorted by expert, ``jax.lax.ragged_dot``) against the dense
path (every expert on every token), at E=8/k=2 and E=64/k=8, and global-batch balancing against micro-batch.

A Mixtral-shaped model trains through the pieces ``functrain train`` uses (the model's Program, ``make_train_step``
with AdamW, jitted with the state donated). For each shape it reports XLA's FLOPs per step of both dispatches
beside the active-parameter arithmetic (:func:`functrain.report.mfu.train_flops_per_token`, which MFU uses), and
the step-time ratio dense / grouped (interleaved repeats, median of the paired ratios; wall clock and process
CPU time). Then, with ``--micro-batches`` micro-batches, the step time of ``load_balance_scope: global_batch``
(a forward-only counting pass over every micro-batch first) against ``micro_batch``.

``--topology v5p:2x2x1`` instead compiles ``jax.lax.ragged_dot`` alone for that TPU (through libtpu, no TPU
needed) and prints XLA's FLOPs of its forward pass and of its gradients with respect to the tokens and to the
expert weights, against the active arithmetic ``2 T H I``: which parts run as a grouped kernel.

    python bench/bench_moe.py [--hidden 128] [--inter 128] [--layers 2] [--batch 8] [--seq 128] [--repeats 3]
    python bench/bench_moe.py --topology v5p:2x2x1
"""

import argparse
import statistics
import sys
from pathlib import Path

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_timing import compiled_flops, compiled_flops_of, timed  # noqa: E402

from functrain.core.program import as_program  # noqa: E402
from functrain.core.state import TrainState  # noqa: E402
from functrain.core.step import make_train_step  # noqa: E402
from functrain.models import build_model  # noqa: E402
from functrain.models.configs.mixtral import MixtralConfig  # noqa: E402
from functrain.report.mfu import train_flops_per_token  # noqa: E402


def build(config: MixtralConfig, batch: dict, micro_batches: int = 1):
    program = as_program(build_model(config), batch)
    tx = optax.adamw(1e-4)
    step = make_train_step(
        program.loss_fn, tx, micro_batches=micro_batches, stateful=True, batch_totals=program.batch_totals
    )
    params, model_state = program.init(jax.random.PRNGKey(0))
    state = TrainState.create(params, tx, jax.random.PRNGKey(1), model_state=model_state)
    return jax.jit(step, donate_argnums=0), state


def paired(variants: dict, batch: dict, steps: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Per variant, ``repeats`` (wall, cpu) seconds per step, the variants interleaved round by round."""
    states = {name: state for name, (_, state) in variants.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, (step, _) in variants.items():
            wall, cpu, states[name] = timed(step, states[name], batch, steps)
            times[name].append((wall, cpu))
    return times


def ratio(times: dict, slow: str, fast: str) -> str:
    walls = [a[0] / b[0] for a, b in zip(times[slow], times[fast])]
    cpus = [a[1] / b[1] for a, b in zip(times[slow], times[fast])]
    return f"wall {statistics.median(walls):.2f}x, cpu {statistics.median(cpus):.2f}x"


def ragged_dot_on_tpu(topology: str, tokens: int = 8192, width: int = 1024, experts: int = 64) -> None:
    """XLA's FLOPs of ``ragged_dot`` [tokens, width] x [experts, width, width], forward and gradients, compiled
    for one chip of ``topology``."""
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    chip = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices[:1]
    replicated = NamedSharding(Mesh(chip, ("chip",)), PartitionSpec())
    x = jax.ShapeDtypeStruct((tokens, width), jnp.bfloat16, sharding=replicated)
    w = jax.ShapeDtypeStruct((experts, width, width), jnp.bfloat16, sharding=replicated)
    sizes = jax.ShapeDtypeStruct((experts,), jnp.int32, sharding=replicated)

    def total(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes).astype(jnp.float32).sum()

    active = 2 * tokens * width * width
    shape = f"[{tokens}, {width}] x [{experts}, {width}, {width}]"
    print(f"{topology}: ragged_dot {shape} bf16; active {active / 1e9:.1f} G")
    for name, function in (("forward", total), ("d/dx", jax.grad(total, 0)), ("d/dw", jax.grad(total, 1))):
        compiled = jax.jit(function).lower(x, w, sizes).compile()
        flops = compiled_flops_of(compiled)
        kernels = compiled.as_text().count("tpu_custom_call")
        print(f"  {name}: XLA FLOPs {flops / 1e9:.1f} G ({flops / active:.1f}x active), grouped kernels: {kernels}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--topology", default=None, help="compile ragged_dot alone for this TPU topology")
    args = parser.parse_args()
    if args.topology:
        ragged_dot_on_tpu(args.topology)
        return
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {"tokens": tokens, "weight": np.ones(args.batch, np.float32)}
    print(f"devices: {jax.devices()[0].device_kind} x{jax.device_count()}; {args.batch} x {args.seq} tokens a step")
    for experts, top_k in ((8, 2), (64, 8)):
        config = MixtralConfig(
            vocab_size=256,
            hidden_size=args.hidden,
            intermediate_size=args.inter,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=args.seq,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            output_router_logits=True,
        )
        variants = {dispatch: build(config.model_copy(update={"moe_dispatch": dispatch}), batch) for dispatch in
                    ("grouped", "dense")}
        flops = {name: compiled_flops(step, state, batch) for name, (step, state) in variants.items()}
        active = train_flops_per_token(config.decoder_shape(), args.seq, attention="full") * args.batch * args.seq
        times = paired(variants, batch, args.steps, args.repeats)
        print(
            f"E={experts} k={top_k}: XLA FLOPs/step grouped {flops['grouped'] / 1e9:.2f} G, dense "
            f"{flops['dense'] / 1e9:.2f} G ({flops['dense'] / flops['grouped']:.2f}x); active-parameter arithmetic "
            f"{active / 1e9:.2f} G (grouped / arithmetic {flops['grouped'] / active:.2f}); step time dense / "
            f"grouped: {ratio(times, 'dense', 'grouped')}"
        )
        del variants
    config = config.model_copy(update={"num_local_experts": 8, "num_experts_per_tok": 2})
    scopes = {scope: build(config.model_copy(update={"load_balance_scope": scope}), batch, args.micro_batches) for
              scope in ("micro_batch", "global_batch")}
    times = paired(scopes, batch, args.steps, args.repeats)
    print(f"E=8 k=2, {args.micro_batches} micro-batches: step time global_batch / micro_batch: "
          f"{ratio(times, 'global_batch', 'micro_batch')}")


if __name__ == "__main__":
    main()
