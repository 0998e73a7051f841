"""Model-FLOPs utilisation (MFU) of the GPT train step on one accelerator.

MFU = model FLOPs per step / step time / (devices x dense peak FLOP/s), as MaxText and Levanter report it.

Model FLOPs per step (forward + backward = 3 x forward):
- matmuls: ``6 * N * tokens``, N = parameters except the token and position embeddings (lookups, not
  matmuls); the untied output head is counted;
- attention scores and mixing: ``12 * L * T * d`` per token (QK^T and AV, 2*T*d FLOPs each per token and
  layer forward). Causal attention needs half of that; the headline MFU counts the half (only the FLOPs the
  model needs), and the line below it also gives the full count, which is what a dense masked kernel
  (flax ``dot_product_attention``) executes.
Peak: dense (not sparse) bf16 FLOP/s looked up from ``device_kind``; ``--peak-tflops`` overrides it. On CPU
there is no peak, so the run is a smoke check that prints achieved TFLOP/s only.

The step is functrain's own: ``JaxBackend`` (sharded state, ``steps_per_call`` steps per compiled call,
donated state), timed after compilation, with the loss read back each call so nothing is left queued.
Usage: ``python bench/bench_mfu.py`` (GPU preset when a GPU is present) or ``--preset cpu``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from functrain.backend import JaxBackend  # noqa: E402
from functrain.config import load_config  # noqa: E402
from functrain.models import build_model  # noqa: E402
from functrain.optim import make_optimizer  # noqa: E402
from functrain.precision import COMPUTE_DTYPES  # noqa: E402
from functrain.program import as_program  # noqa: E402

# Dense bf16 peak TFLOP/s per device, matched against jax's device_kind (first match wins).
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("GH200", 989.0), ("H800", 989.0),
    ("B200", 2250.0), ("A100", 312.0), ("A10G", 125.0), ("L40S", 362.0), ("L4", 121.0), ("V100", 125.0),
    ("TPU v4", 275.0), ("TPU v5 lite", 197.0), ("TPU v5e", 197.0), ("TPU v5p", 459.0), ("TPU v5", 459.0),
    ("TPU v6", 918.0),
)

PRESETS = {
    # ~200M parameters, 16k tokens per step: big enough that matmuls, not dispatch, set the step time.
    "gpu": dict(model=dict(vocab_size=32768, max_len=1024, d_model=1024, n_layers=12, n_heads=16, d_ff=4096),
                batch=16, seq=1024, dtype="bfloat16", steps_per_call=10, calls=5),
    "cpu": dict(model=dict(vocab_size=256, max_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=512),
                batch=8, seq=128, dtype="float32", steps_per_call=2, calls=3),
}


def _flops(value: float) -> str:
    return f"{value / 1e12:.3f} TFLOP" if value >= 1e11 else f"{value / 1e9:.3f} GFLOP"


def peak_tflops(device_kind: str) -> float | None:
    """Dense bf16 peak of one device, or None when unknown (CPU)."""
    for name, tflops in PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


def model_flops_per_step(params: dict, n_layers: int, d_model: int, batch: int, seq: int) -> dict[str, float]:
    """Training FLOPs per step: ``matmul`` (6 N tokens), ``attention`` (full 12 L T d per token) and
    ``attention_causal`` (half of it)."""
    embeddings = {"token_embed", "position_embed"}
    n_matmul = sum(leaf.size for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
                   if not embeddings & {getattr(key, "key", None) for key in path})
    tokens = batch * seq
    attention = 12.0 * n_layers * seq * d_model * tokens
    return {"params_matmul": float(n_matmul), "matmul": 6.0 * n_matmul * tokens, "attention": attention,
            "attention_causal": attention / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model size (default: gpu when a GPU/TPU is present, else cpu)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the per-device dense peak")
    parser.add_argument("--calls", type=int, default=None, help="timed calls (after one warm-up call)")
    args = parser.parse_args()
    device = jax.devices()[0]
    preset = PRESETS[args.preset or ("cpu" if device.platform == "cpu" else "gpu")]
    calls = args.calls or preset["calls"]
    batch, seq, k = preset["batch"], preset["seq"], preset["steps_per_call"]
    overrides = [f"model.{key}={value}" for key, value in preset["model"].items()] + [
        f"data.global_batch_size={batch}", f"data.seq_len={seq}", f"train.compute_dtype={preset['dtype']}",
        f"train.steps_per_call={k}", "log.every_steps=" + str(k), "mesh.data=-1"]
    config = load_config(None, overrides, base={"model": {"name": "gpt"}})
    rng = np.random.default_rng(0)
    host_batches = {"tokens": rng.integers(0, preset["model"]["vocab_size"], (k, batch, seq + 1), np.int32),
                    "weight": np.ones((k, batch), np.float32)}
    program = as_program(build_model(config.model, COMPUTE_DTYPES[config.train.compute_dtype]),
                         {name: value[0] for name, value in host_batches.items()})
    tx, schedule = make_optimizer(config.optimizer, (calls + 1) * k)
    backend = JaxBackend(config, program, tx, schedule, total_steps=(calls + 1) * k)
    state = backend.init_state()
    batches = backend.place(host_batches)

    start = time.perf_counter()
    state, metrics = backend.train_call(state, batches)
    backend.to_host(metrics["loss"])
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        state, metrics = backend.train_call(state, batches)
        backend.to_host(metrics["loss"])  # the call is done only when its outputs are
        times.append((time.perf_counter() - start) / k)
    step_s = float(np.median(times))

    flops = model_flops_per_step(state.params, config.model.n_layers, config.model.d_model, batch, seq)
    devices = jax.device_count()
    needed = flops["matmul"] + flops["attention_causal"]
    executed = flops["matmul"] + flops["attention"]
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    print(f"device: {device.device_kind} x{devices} ({device.platform}); dense peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown'}")
    print(f"GPT {preset['model']}, {flops['params_matmul'] / 1e6:.1f}M non-embedding params, batch {batch}x{seq} "
          f"= {batch * seq} tokens/step, {preset['dtype']} compute, {k} steps per call")
    print(f"step {step_s * 1e3:.2f} ms (median of {calls} calls; first call incl. compile {compile_s:.1f} s), "
          f"{batch * seq / step_s:,.0f} tokens/s")
    print(f"model FLOPs/step: matmul {_flops(flops['matmul'])} + attention {_flops(flops['attention'])} full / "
          f"{_flops(flops['attention_causal'])} causal")
    achieved = needed / step_s / devices / 1e12
    achieved_full = executed / step_s / devices / 1e12
    if peak:
        print(f"MFU {achieved / peak:.1%} (causal attention halved; {achieved:.1f} TFLOP/s per device); "
              f"{achieved_full / peak:.1%} counting full attention ({achieved_full:.1f} TFLOP/s)")
    else:
        print(f"achieved {achieved:.3f} TFLOP/s per device (causal halved), {achieved_full:.3f} counting full "
              f"attention; MFU needs a known peak (--peak-tflops)")
    # XLA's own count of the compiled call, as a cross-check of the formula (not every backend has it). It
    # counts a while loop's body once, so the scan over K steps reports one step.
    try:
        cost = jax.jit(backend.train_call).lower(state, batches).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost and cost.get("flops"):
            print(f"XLA cost analysis: {_flops(cost['flops'])}/step incl. elementwise and optimizer ops "
                  f"(formula, full attention: {_flops(executed)})")
    except Exception as exc:  # noqa: BLE001 - a cross-check only; never fail the benchmark over it
        print(f"XLA cost analysis unavailable: {type(exc).__name__}")


if __name__ == "__main__":
    main()
