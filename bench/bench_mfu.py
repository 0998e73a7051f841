"""Model-FLOPs utilisation (MFU) of the GPT train step on one accelerator.

MFU = model FLOPs per step / step time / (devices x dense peak FLOP/s), as MaxText and Levanter report it.

Model FLOPs per step: ``functrain.mfu.train_flops_per_token`` (the formula is in that module's docstring; the
head is counted, embedding lookups are not) times the tokens of a step. The headline MFU counts causal
attention as half of full attention (only the FLOPs the model needs, MaxText's convention); the full count,
what a dense masked kernel executes, is printed beside it.
Peak: dense (not sparse) bf16 FLOP/s looked up from ``device_kind``; ``--peak-tflops`` overrides it. On CPU
there is no peak, so the run is a smoke check that prints achieved TFLOP/s only.

The step is functrain's own: ``JaxBackend`` (sharded state, ``steps_per_call`` steps per compiled call,
donated state), timed after compilation, with the loss read back each call so nothing is left queued.
Usage: ``python bench/bench_mfu.py`` (``configs/gpt_350m.yaml`` when a GPU is present, else a small CPU GPT),
``--preset cpu|gpu`` or ``--config FILE``.
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
from functrain.config import Config, load_config  # noqa: E402
from functrain.mfu import decoder_shape, peak_tflops, train_flops_per_token  # noqa: E402
from functrain.tasks import make_task  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PRESETS = {
    # ~350M parameters, 16k tokens per step in bf16: big enough that matmuls, not dispatch, set the step time.
    "gpu": REPO / "configs" / "gpt_350m.yaml",
    # A smoke check of the same path on a CPU.
    "cpu": dict(model=dict(vocab_size=256, max_len=128, d_model=128, n_layers=2, n_heads=4, d_ff=512),
                batch=8, seq=128, dtype="float32", steps_per_call=2),
}


def preset_config(preset: Path | dict) -> Config:
    """The run config of a preset: a YAML file, or a small GPT described inline."""
    if isinstance(preset, Path):
        return load_config(preset, ["mesh.data=-1"])
    overrides = [f"model.{key}={value}" for key, value in preset["model"].items()] + [
        f"data.global_batch_size={preset['batch']}", f"data.seq_len={preset['seq']}",
        f"train.compute_dtype={preset['dtype']}", f"train.steps_per_call={preset['steps_per_call']}",
        f"log.every_steps={preset['steps_per_call']}", "mesh.data=-1"]
    return load_config(None, overrides, base={"model": {"name": "gpt"}})


def _flops(value: float) -> str:
    return f"{value / 1e12:.3f} TFLOP" if value >= 1e11 else f"{value / 1e9:.3f} GFLOP"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model size (default: gpu, configs/gpt_350m.yaml, when a GPU/TPU is present, else cpu)")
    parser.add_argument("--config", type=Path, default=None, help="a run config to measure instead of a preset")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the per-device dense peak")
    parser.add_argument("--calls", type=int, default=5, help="timed calls (after one warm-up call)")
    args = parser.parse_args()
    device = jax.devices()[0]
    config = preset_config(args.config or PRESETS[args.preset or ("cpu" if device.platform == "cpu" else "gpu")])
    calls = args.calls
    batch, seq, k = config.data.global_batch_size, config.data.seq_len, config.train.steps_per_call
    rng = np.random.default_rng(0)
    host_batches = {"tokens": rng.integers(0, config.model.vocab_size, (k, batch, seq + 1), np.int32),
                    "weight": np.ones((k, batch), np.float32)}
    task = make_task(config, {name: value[0] for name, value in host_batches.items()})
    backend = JaxBackend(config, task, total_steps=(calls + 1) * k)
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

    shape = decoder_shape(config.model)
    tokens = batch * seq
    devices = jax.device_count()
    needed = train_flops_per_token(shape, seq, attention="causal") * tokens
    executed = train_flops_per_token(shape, seq, attention="full") * tokens
    n_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    print(f"device: {device.device_kind} x{devices} ({device.platform}); dense peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown'}")
    print(f"GPT d_model {config.model.d_model} x {config.model.n_layers} layers, {n_params / 1e6:.1f}M params, "
          f"batch {batch}x{seq} = {batch * seq} tokens/step, {config.train.compute_dtype} compute, "
          f"{k} steps per call")
    print(f"step {step_s * 1e3:.2f} ms (median of {calls} calls; first call incl. compile {compile_s:.1f} s), "
          f"{batch * seq / step_s:,.0f} tokens/s")
    print(f"model FLOPs/step (functrain.mfu): {_flops(needed)} with causal attention, {_flops(executed)} with full")
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
