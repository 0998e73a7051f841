"""Gated DeltaNet on TPU v5p, as a plan sees it (compiled ahead of time on this CPU: no TPU is needed or used).

One chip of ``v5p:2x2x1``, 4096 tokens, Qwen3-Next-80B-A3B's widths (HybridConfig's defaults: 16 key heads and 32
value heads of 128, chunks of 64; full attention 16 query heads, 2 key/value heads of 256). Each case is compiled
for the chip and counted as ``functrain plan`` counts a step (:func:`functrain.plan.counting.step_cost`: every loop
unrolled, the Pallas kernel's FLOPs from its cost estimate); its roofline time is ``max(FLOPs / peak, bytes / HBM
bandwidth)`` at the chip's bf16 peak (the kernel's float32 matmuls at HIGHEST precision take about 6 bf16 passes and
each grid step has its own cost, which the roofline leaves out: see docs/plan.md). Also shown: libtpu's own
``cost_analysis()`` (loop bodies counted once), temporaries, and the program's fusions, loops and kernels.

Cases: the delta rule alone, forward and forward+backward, by XLA's chunked form and by the Pallas kernels
(``model.gdn_kernel=pallas``: the forward kernel and the backward kernel); with the gradient also the Pallas forward
with XLA's backward (the XLA form recomputed and differentiated: what ``pallas`` ran before its backward kernel);
then whole layers forward+backward in bfloat16: the Gated DeltaNet layer (XLA form) and the gated full-attention
layer (splash, whose FLOPs are added from their formula, ``6 T^2 H D``, as a plan adds them), for their arithmetic
intensity (FLOPs per HBM byte).

Usage: python bench/bench_gdn_kernel.py [--tokens 4096] [--cases rule_fwd,rule_grad,layers]
"""

from __future__ import annotations

import argparse
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from functrain.models.configs.qwen3_next import Qwen3NextConfig
from functrain.models.delta_rule import chunked_delta_rule
from functrain.models.delta_rule_pallas import pallas_delta_rule
from functrain.models.gated_attention import GatedAttention
from functrain.models.gated_deltanet import GatedDeltaNet
from functrain.parallel.chips import chip_of
from functrain.plan.counting import step_cost
from functrain.plan.planner import topology_devices

CONFIG = Qwen3NextConfig()
CHIP = chip_of("TPU v5p")


def figures(name: str, compiled: jax.stages.Compiled, extra_flops: float = 0.0) -> dict:
    """Print and return a compiled case's counted FLOPs, bytes, roofline time, intensity and program shape."""
    counted = step_cost(compiled, steps_per_call=1)
    flops, moved = counted["flops"] + extra_flops, counted["bytes accessed"]
    seconds = max(flops / CHIP.peak_flops, moved / CHIP.hbm_bandwidth)
    libtpu = compiled.cost_analysis()
    libtpu = libtpu[0] if isinstance(libtpu, list) else libtpu
    text = compiled.as_text()
    row = dict(
        flops=flops,
        bytes=moved,
        roofline_ms=1e3 * seconds,
        intensity=flops / moved,
        temp_mib=compiled.memory_analysis().temp_size_in_bytes / 2**20,
        fusions=len(re.findall(r"= [^=]*\bfusion\(", text)),
        loops=len(re.findall(r"\bwhile\(", text)),
        kernels=text.count("tpu_custom_call"),
        libtpu_flops=libtpu.get("flops", 0.0),
        libtpu_bytes=libtpu.get("bytes accessed", 0.0),
    )
    print(
        f"{name:28s} {flops / 1e9:8.2f} GFLOP {moved / 2**20:9.1f} MiB  roofline {row['roofline_ms']:7.3f} ms  "
        f"{row['intensity']:7.1f} FLOP/B  temp {row['temp_mib']:7.1f} MiB  fusions {row['fusions']:4d}  "
        f"loops {row['loops']}  kernels {row['kernels']}  (libtpu: {row['libtpu_flops'] / 1e9:.2f} GFLOP, "
        f"{row['libtpu_bytes'] / 2**20:.1f} MiB)",
        flush=True,
    )
    return row


def rule_inputs(tokens: int, sharding: jax.sharding.Sharding) -> dict:
    """The delta rule's inputs as the layer gives them (bfloat16 activations, float32 decays and strengths)."""
    heads, value_heads = CONFIG.linear_num_key_heads, CONFIG.linear_num_value_heads
    key_dim, value_dim = CONFIG.linear_key_head_dim, CONFIG.linear_value_head_dim
    by_head = ((1, tokens, value_heads), jnp.float32)
    shapes = dict(query=((1, tokens, heads, key_dim), jnp.bfloat16), key=((1, tokens, heads, key_dim), jnp.bfloat16),
                  value=((1, tokens, value_heads, value_dim), jnp.bfloat16), decay=by_head, beta=by_head)  # fmt: skip
    return {name: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for name, (shape, dtype) in shapes.items()}


def pallas_forward_xla_backward(*, chunk_size: int, **arrays: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The Pallas forward kernel, differentiated by XLA's chunked form (recomputed, and its VJP taken)."""
    size = chunk_size

    @jax.custom_vjp
    def rule(arrays: dict) -> tuple[jax.Array, jax.Array]:
        return pallas_delta_rule(**arrays, chunk_size=size)

    def forward(arrays: dict) -> tuple[tuple[jax.Array, jax.Array], dict]:
        return rule(arrays), arrays

    def backward(arrays: dict, cotangents: tuple) -> tuple[dict]:
        return jax.vjp(lambda a: chunked_delta_rule(**a, chunk_size=size), arrays)[1](cotangents)

    rule.defvjp(forward, backward)
    return rule(arrays)


def rule_cases(tokens: int, sharding: jax.sharding.Sharding, backward: bool) -> dict:
    """The delta rule by each kernel, forward or forward+backward (a weighted sum's gradient of every input)."""
    inputs, rows = rule_inputs(tokens, sharding), {}
    kernels = [("xla", chunked_delta_rule), ("pallas", pallas_delta_rule)]
    if backward:
        kernels.insert(1, ("pallas, xla bwd", pallas_forward_xla_backward))
    for kernel, rule in kernels:
        forward = lambda arrays, rule=rule: rule(**arrays, chunk_size=CONFIG.linear_chunk_size)  # noqa: E731
        # The loss is returned, as a train step uses it: else a forward kernel whose output only the loss reads
        # (when XLA's form is recomputed for the backward) would be dropped from the program.
        trained = lambda arrays, f=forward: jax.value_and_grad(lambda a: jnp.sum(f(a)[0]))(arrays)  # noqa: E731
        step = trained if backward else forward
        start = time.process_time()
        compiled = jax.jit(step).lower(inputs).compile()
        name = f"delta rule {kernel} {'fwd+bwd' if backward else 'fwd'}"
        rows[kernel] = figures(name, compiled)
        print(f"  ({time.process_time() - start:.0f} CPU-s to compile)", flush=True)
    for kernel in rows:
        print(f"  {kernel} / xla roofline time: {rows[kernel]['roofline_ms'] / rows['xla']['roofline_ms']:.2f}")
    return rows


def layer_cases(tokens: int, sharding: jax.sharding.Sharding) -> dict:
    """The Gated DeltaNet layer (XLA form) and the gated attention layer (splash), forward+backward, bfloat16."""
    config = CONFIG.model_copy(update={"attention": "splash"})
    x = jax.ShapeDtypeStruct((1, tokens, config.hidden_size), jnp.bfloat16, sharding=sharding)
    heads, head_dim = config.num_attention_heads, config.head_dim
    # Causal: forward 2 matmuls of 2 T^2 H D FLOPs, backward 4, half the scores each.
    splash = 6 * tokens * tokens * heads * head_dim
    rows = {}
    for name, layer, extra in (("gdn layer", GatedDeltaNet(config, jnp.bfloat16), 0.0),
                               ("attention layer", GatedAttention(config, jnp.bfloat16), splash)):  # fmt: skip
        # The key and example are made inside the traced function: no eager op under the TPU mesh.
        params = jax.eval_shape(lambda m=layer: m.init(jax.random.PRNGKey(0), jnp.zeros((1, 8, config.hidden_size))))
        params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding), params)

        def loss(p: dict, h: jax.Array, layer=layer) -> jax.Array:
            return jnp.sum(layer.apply(p, h).astype(jnp.float32))

        compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
        rows[name] = figures(f"{name} fwd+bwd", compiled, extra)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--cases", default="rule_fwd,rule_grad,layers")
    args = parser.parse_args()
    mesh = jax.sharding.Mesh(np.array(topology_devices("v5p:2x2x1")[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    print(
        f"TPU v5p, one chip: peak {CHIP.peak_flops / 1e12:.0f} TFLOP/s (bf16), HBM {CHIP.hbm_bandwidth / 1e12:.2f} "
        f"TB/s; {args.tokens} tokens; no TPU attached (compiled ahead of time)"
    )
    cases = args.cases.split(",")
    with jax.set_mesh(mesh):  # Mosaic lowers for the mesh's chip
        if "rule_fwd" in cases:
            rule_cases(args.tokens, sharding, backward=False)
        if "rule_grad" in cases:
            rule_cases(args.tokens, sharding, backward=True)
        if "layers" in cases:
            layer_cases(args.tokens, sharding)


if __name__ == "__main__":
    main()
