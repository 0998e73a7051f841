"""Model-FLOPs utilisation (MFU) of the GPT train step on one accelerator.

MFU = model FLOPs per step / step time / (devices x dense peak FLOP/s), as MaxText and Levanter report it.

Model FLOPs per step: ``functrain.report.mfu.train_flops_per_token`` (the formula is in that module's docstring; the
head is counted, embedding lookups are not) times the tokens of a step. The headline MFU counts causal
attention as half of full attention (only the FLOPs the model needs, MaxText's convention); the full count,
what a dense masked kernel executes, is printed beside it.
Peak: dense (not sparse) bf16 FLOP/s looked up from ``device_kind``; ``--peak-tflops`` overrides it. On CPU
there is no peak, so the run is a smoke check that prints achieved TFLOP/s only.

The step is functrain's own: ``JaxBackend`` (sharded state, ``steps_per_call`` steps per compiled call,
donated state), timed after compilation, with the loss read back each call so nothing is left queued.
Measured in the same run, calls interleaved round by round (the ratios are the point, not the times):

- ``hand-written``: the same model in plain Flax + optax (value_and_grad, clip + AdamW, ``lax.scan`` over the
  same K steps, donated params and optimizer state): functrain's step should cost nothing beside it;
- ``remat=full`` / ``remat=dots_saveable``: functrain with ``model.remat`` (tokens/s and memory vs none);
- ``offload_optimizer``: functrain with the optimizer state in pinned host memory (GPU/TPU only);
- ``deterministic=false`` (GPU only): functrain without XLA's deterministic GPU ops (``train.deterministic``,
  on by default for bitwise resume), with cuDNN's flash attention, as the hand-written step runs;
- ``fp8``: functrain with ``train.fp8`` (the projections as FP8 products; with ``deterministic=false``'s kernels
  on a GPU, to be compared with that variant): its MFU is counted against the bf16 peak, as torchtitan reports it;
- ``logits_chunk=off``: functrain with the whole logits (``train.logits_chunk``; ``auto`` chunks large ones and
  computes the head's product again in the backward), as the hand-written step, and its GPU kernels.

Memory: XLA's compiled memory analysis of each train call (device arguments + temporaries), so one process
measures every variant. Usage: ``python bench/bench_mfu.py`` (``configs/gpt_350m.yaml`` when a GPU is present,
else a small CPU GPT), ``--preset cpu|gpu``, ``--config FILE``, ``--variants deterministic=false,hand-written``
(measure only those, the first for the MFU line: each variant compiles once, a minute or two for the GPU preset).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from functrain.core.program import as_program  # noqa: E402
from functrain.run.backends import jax_backend  # noqa: E402
from functrain.config.schema import Config  # noqa: E402
from functrain.config.load import load_config  # noqa: E402
from functrain.report.mfu import peak_tflops, train_flops_per_token  # noqa: E402
from functrain.models import build_model  # noqa: E402
from functrain.parallel.memory import host_offload_available  # noqa: E402
from functrain.core.optim import decay_mask  # noqa: E402
from functrain.core.precision import COMPUTE_DTYPES, PARAM_DTYPES, cast_floating  # noqa: E402

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


def _device_bytes(compiled) -> int:
    """Device memory of a compiled call: its arguments and temporaries (XLA's memory analysis)."""
    stats = compiled.memory_analysis()
    return int(stats.argument_size_in_bytes + stats.temp_size_in_bytes) if stats else 0


class Functrain:
    """functrain's compiled train call for ``config``; ``call()`` runs K steps and waits for the loss."""

    def __init__(self, config: Config, host_batches: dict, total_steps: int) -> None:
        model = build_model(config.model, COMPUTE_DTYPES[config.train.compute_dtype])
        example = {name: value[0] for name, value in host_batches.items()}
        program = as_program(model, example, kind="causal_lm", logits_chunk=config.train.logits_chunk)
        self.backend = jax_backend(config, program, total_steps)  # as a run builds it
        self.state = self.backend.init_state()
        self.batches = self.backend.place(host_batches)

    def call(self) -> None:
        self.state, metrics = self.backend.train_call(self.state, self.batches)
        self.backend.to_host(metrics["loss"])  # the call is done only when its outputs are

    def compiled(self):
        """The train call compiled again for XLA's analyses."""
        return self.backend.compile_train_call(self.state, self.batches)


class HandWritten:
    """The same GPT and AdamW + clipping in plain Flax + optax, K steps per call under ``lax.scan``."""

    def __init__(self, config: Config, host_batches: dict, total_steps: int) -> None:
        dtype = COMPUTE_DTYPES[config.train.compute_dtype]
        model = build_model(config.model, dtype)
        opt = config.optimizer
        # A constant rate: the schedule's value does not change the step's cost.
        tx = optax.chain(optax.clip_by_global_norm(config.train.clip_norm or float("inf")),
                         optax.adamw(opt.learning_rate, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                                     weight_decay=opt.weight_decay, mask=decay_mask))
        tokens = jnp.asarray(host_batches["tokens"])
        params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens[0, :, :-1])["params"]
        self.params = cast_floating(nn.meta.unbox(params), PARAM_DTYPES[config.train.param_dtype])
        self.opt_state = tx.init(self.params)
        self.tokens = tokens

        def one_step(carry, batch_tokens):
            params, opt_state = carry

            def loss_fn(p):
                logits = model.apply({"params": cast_floating(p, dtype)}, batch_tokens[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, batch_tokens[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        def steps(params, opt_state, tokens):
            (params, opt_state), losses = jax.lax.scan(one_step, (params, opt_state), tokens)
            return params, opt_state, losses

        self.steps = jax.jit(steps, donate_argnums=(0, 1))

    def call(self) -> None:
        self.params, self.opt_state, losses = self.steps(self.params, self.opt_state, self.tokens)
        np.asarray(losses)

    def compiled(self):
        """The K-step call compiled again for XLA's analyses."""
        return self.steps.lower(self.params, self.opt_state, self.tokens).compile()


def variants(config: Config) -> dict[str, tuple[type, Config]]:
    """The variants this device can run: name -> (runner, config); functrain as configured first."""
    chosen = {"functrain": (Functrain, config)}
    chosen["hand-written"] = (HandWritten, config)
    for policy in ("full", "dots_saveable"):
        chosen[f"remat={policy}"] = (Functrain, config.model_copy(
            update={"model": config.model.model_copy(update={"remat": policy})}))
    fast = {"deterministic": False} if jax.devices()[0].platform == "gpu" else {}
    if fast:  # XLA's faster non-deterministic GPU kernels and cuDNN's attention
        chosen["deterministic=false"] = (Functrain, config.model_copy(
            update={"train": config.train.model_copy(update=fast)}))
    chosen["fp8"] = (Functrain, config.model_copy(update={"train": config.train.model_copy(update={**fast, "fp8": True})}))
    # The whole logits, as the hand-written step forms them (and its kernels on a GPU): what chunking them costs.
    chosen["logits_chunk=off"] = (Functrain, config.model_copy(
        update={"train": config.train.model_copy(update={**fast, "logits_chunk": "off"})}))
    if host_offload_available():
        chosen["offload_optimizer"] = (Functrain, config.model_copy(
            update={"train": config.train.model_copy(update={"offload_optimizer": True})}))
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model size (default: gpu, configs/gpt_350m.yaml, when a GPU/TPU is present, else cpu)")
    parser.add_argument("--config", type=Path, default=None, help="a run config to measure instead of a preset")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the per-device dense peak")
    parser.add_argument("--calls", type=int, default=None,
                        help="timed calls per variant after one warm-up call (default: 40 on CPU, 5 elsewhere)")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variants to measure, the first for the MFU line (default: all this "
                             "device runs, functrain first)")
    args = parser.parse_args()
    device = jax.devices()[0]
    config = preset_config(args.config or PRESETS[args.preset or ("cpu" if device.platform == "cpu" else "gpu")])
    available = variants(config)
    names = args.variants.split(",") if args.variants else list(available)
    unknown = [name for name in names if name not in available]
    if unknown or not names or names[0] == "hand-written":
        parser.error(f"--variants {args.variants}: choose from {', '.join(available)}, a functrain variant first")
    calls = args.calls or (40 if device.platform == "cpu" else 5)
    batch, seq, k = config.data.global_batch_size, config.data.seq_len, config.train.steps_per_call
    rng = np.random.default_rng(0)
    host_batches = {"tokens": rng.integers(0, config.model.vocab_size, (k, batch, seq + 1), np.int32),
                    "weight": np.ones((k, batch), np.float32)}
    total_steps = (calls + 1) * k
    runners = {}
    for name in names:
        runner, variant_config = available[name]
        start = time.perf_counter()
        runners[name] = runner(variant_config, host_batches, total_steps)
        runners[name].call()
        print(f"{name}: first call incl. compile {time.perf_counter() - start:.1f} s", flush=True)
    times = {name: [] for name in runners}
    for round_ in range(calls):  # interleaved, so a slow spell of a shared machine hits every variant alike
        for name, runner in (runners.items() if round_ % 2 == 0 else reversed(runners.items())):
            start = time.perf_counter()
            runner.call()
            times[name].append((time.perf_counter() - start) / k)
    step_s = {name: float(np.median(values)) for name, values in times.items()}
    compiled = {name: runner.compiled() for name, runner in runners.items()}
    headline = names[0]
    state = runners[headline].state
    step_time = step_s[headline]
    shape = config.model.decoder_shape()
    tokens = batch * seq
    devices = jax.device_count()
    needed = train_flops_per_token(shape, seq, attention="causal") * tokens
    executed = train_flops_per_token(shape, seq, attention="full") * tokens
    n_params = sum(leaf.size for leaf in jax.tree.leaves(state.params))
    peak = args.peak_tflops or peak_tflops(device.device_kind)
    print(f"device: {device.device_kind} x{devices} ({device.platform}); dense peak "
          f"{f'{peak:.0f} TFLOP/s' if peak else 'unknown'}")
    print(f"{config.model.name} width {shape.width} x {shape.layers} layers, {n_params / 1e6:.1f}M params, "
          f"batch {batch}x{seq} = {batch * seq} tokens/step, {config.train.compute_dtype} compute, "
          f"{k} steps per call")
    for name, seconds in step_s.items():
        mfu = f", MFU {needed / seconds / devices / 1e12 / peak:.1%} of the bf16 peak" if peak else ""
        print(f"{name:>19}: step {seconds * 1e3:8.2f} ms (median of {calls} calls), "
              f"{batch * seq / seconds:12,.0f} tokens/s, {step_time / seconds:5.2f}x {headline}'s tokens/s, "
              f"device memory {_device_bytes(compiled[name]) / 2**30:.3f} GiB{mfu}")
    if "hand-written" in step_s:
        # Each round times both calls back to back, so a slow spell of a shared machine hits both alike. On a GPU
        # the hand-written step runs XLA's default (non-deterministic) kernels: compare functrain's alike.
        same_kernels = "deterministic=false" if "deterministic=false" in times else headline
        paired = np.array(times["hand-written"]) / np.array(times[same_kernels])
        print(f"{same_kernels} / hand-written Flax + optax tokens/s: {np.median(paired):.3f} (median of {calls} "
              f"interleaved rounds; quartiles {np.quantile(paired, 0.25):.3f}-{np.quantile(paired, 0.75):.3f})")
    print(f"model FLOPs/step (functrain.report.mfu): {_flops(needed)} with causal attention, {_flops(executed)} with full")
    achieved = needed / step_time / devices / 1e12
    achieved_full = executed / step_time / devices / 1e12
    if peak:
        print(f"{headline} MFU {achieved / peak:.1%} (causal attention halved; {achieved:.1f} TFLOP/s per device); "
              f"{achieved_full / peak:.1%} counting full attention ({achieved_full:.1f} TFLOP/s)")
    else:
        print(f"achieved {achieved:.3f} TFLOP/s per device (causal halved), {achieved_full:.3f} counting full "
              f"attention; MFU needs a known peak (--peak-tflops)")
    # XLA's own count of the compiled call, as a cross-check of the formula (not every backend has it). It
    # counts a while loop's body once, so the scan over K steps reports one step.
    try:
        cost = compiled[headline].cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if cost and cost.get("flops"):
            print(f"XLA cost analysis: {_flops(cost['flops'])}/step incl. elementwise and optimizer ops "
                  f"(formula, full attention: {_flops(executed)})")
    except Exception as exc:  # noqa: BLE001 - a cross-check only; never fail the benchmark over it
        print(f"XLA cost analysis unavailable: {type(exc).__name__}")


if __name__ == "__main__":
    main()
