"""Benchmark a transformers GPT-2 trained through the torch bridge against the same model under
transformers.Trainer, in one run.

Both train ``GPT2LMHeadModel`` built from the same small ``GPT2Config`` (same initial weights, dropout on)
on the same batches of byte windows from the bundled text, with AdamW (decay on matrices only, as Trainer
does), global-norm clipping at 1.0 and a constant rate:

- bridge:  ``make_backend(config, ..., model=model)`` then ``TorchBackend.train_call`` one step per call
           (host batch -> tensors -> pure step -> metrics), the loop's path with the built-in causal-LM loss;
- bridge compiled: the same with ``train.torch_compile=true`` (the module's training forward through
           ``torch.compile``; its compilation, minutes on a CPU, is reported apart and not in the rate);
- Trainer: ``transformers.Trainer.train()`` with the equivalent TrainingArguments (``labels`` = the inputs;
           the model shifts them), its step ends timed by a callback.

A rate is 1 / the median step time after the first 10 steps (start-up is not counted). Each round runs
all three (the order rotates); a ratio is the median of the per-round ratios, so load from other
processes on a shared machine hits all alike. Trainer keeps its defaults (no ``torch_compile``);
``--trainer-compile`` adds Trainer with ``torch_compile=True`` as a fourth contender.

    python bench/bench_torch_user_model.py [--rounds 5] [--steps 100] [--device cpu|cuda] [--threads 1] [--check]
                                           [--width 64] [--layers 2] [--batch 16] [--seq-len 32]
                                           [--no-compile] [--trainer-compile]

The default size is the model of examples/torch_transformers_gpt2.py. The eager bridge's edge is per-step
overhead (no data loader, no accelerate wrapper, foreach optimizer arithmetic), so it shrinks as the
model's compute grows; ``--width 128 --seq-len 64`` is a compute-bound size on a CPU thread. The compiled
bridge also cuts the model's own compute (fused elementwise kernels in the forward and the backward).
``--check`` exits 1 unless compiled bridge/Trainer >= 1.2 (``--no-compile``: the uncompiled bridge's).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from functrain.config.load import load_config
from functrain.data.datasets import bundled_text, text_windows
from functrain.run.backends import torch_backend as make_backend
from torch_bridge.user_model import build_module

REPO = Path(__file__).resolve().parents[1]
LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
WARMUP = 10  # steps before the clock starts


def gpt2(width: int, layers: int, seq_len: int) -> GPT2LMHeadModel:
    """A byte-vocabulary GPT-2 (tied head, dropout 0.1), the same initial weights every time."""
    config = GPT2Config(vocab_size=256, n_positions=seq_len, n_embd=width, n_layer=layers,
                        n_head=max(width // 32, 1), bos_token_id=0, eos_token_id=0)
    return build_module(lambda: GPT2LMHeadModel(config), seed=0)


def batches(steps: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """Every step's ``[batch, seq_len + 1]`` token windows (the same for both contenders)."""
    tokens = text_windows(bundled_text(), seq_len)["tokens"]
    rng = np.random.default_rng(0)
    return [tokens[rng.choice(len(tokens), batch, replace=False)] for _ in range(steps)]


def bridge_rate(steps: list[np.ndarray], device: str, model: GPT2LMHeadModel, compile_: bool = False,
                ) -> tuple[float, float]:
    """Steps per second of the bridge's train call on a user module, one step per call, and the seconds
    of the first step (with ``compile_``, the compilation)."""
    batch, seq_len = steps[0].shape[0], steps[0].shape[1] - 1
    config = load_config(REPO / "configs" / "char_gpt_torch.yaml", [
        f"train.max_steps={len(steps)}", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
        f"optimizer.learning_rate={LR}", f"optimizer.weight_decay={WEIGHT_DECAY}", "optimizer.b2=0.999",
        f"train.clip_norm={CLIP}", "train.steps_per_call=1", "log.every_steps=1", "eval.every_steps=0",
        "checkpoint.every_steps=0", f"data.seq_len={seq_len}", f"data.global_batch_size={batch}",
        f"train.torch_compile={str(compile_).lower()}"])
    weight = np.ones(batch, np.float32)
    backend = make_backend(config, {"tokens": steps[0], "weight": weight}, len(steps), model=model)
    state = backend.init_state()
    clock = [time.perf_counter()]
    for tokens in steps:
        state, metrics = backend.train_call(state, {"tokens": tokens[None], "weight": weight[None]})
        _sync(device)
        clock.append(time.perf_counter())
    return steady_rate(clock[1:]), clock[1] - clock[0]


def trainer_rate(steps: list[np.ndarray], device: str, model: GPT2LMHeadModel, workdir: Path,
                 compile_: bool = False) -> float:
    """Steady-state steps per second of transformers.Trainer on the same batches (``compile_``: with
    ``TrainingArguments(torch_compile=True)``)."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Windows(torch.utils.data.Dataset):
        """The benchmark's batches flattened into examples in order (Trainer re-batches them)."""
        def __init__(self):
            self.rows = np.concatenate(steps)

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, index):
            inputs = torch.from_numpy(self.rows[index][:-1].astype(np.int64))
            return {"input_ids": inputs, "labels": inputs}  # GPT2LMHeadModel shifts the labels itself

    class StepClock(TrainerCallback):
        times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            _sync(device)
            StepClock.times.append(time.perf_counter())

    StepClock.times = []
    args = TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=len(steps[0]), max_steps=len(steps),
        learning_rate=LR, weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=10**9, save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=device == "cpu", dataloader_num_workers=0, seed=0, torch_compile=compile_)
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)  # keep the benchmark's output to its own table
    trainer.train()
    return steady_rate(StepClock.times)


def steady_rate(clock: list[float]) -> float:
    """Steps per second from the end time of every step: 1 / the median step time after the first WARMUP.

    The median, not the mean, so a burst of load from other processes on a shared machine, which lands on
    a few steps of one contender, does not decide the ratio."""
    return float(1.0 / statistics.median(np.diff(clock[WARMUP - 1:])))


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for both contenders")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled bridge")
    parser.add_argument("--trainer-compile", action="store_true",
                        help="also time Trainer with torch_compile=True (not its default)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the ratio meets the target")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    steps = batches(args.steps, args.batch, args.seq_len)

    def model() -> GPT2LMHeadModel:  # a fresh copy for each contender
        return gpt2(args.width, args.layers, args.seq_len)

    contenders = {
        "bridge": lambda: bridge_rate(steps, args.device, model())[0],
        "Trainer": lambda: trainer_rate(steps, args.device, model(), Path(workdir)),
    }
    compile_seconds: list[float] = []
    if not args.no_compile:
        def compiled_bridge() -> float:
            rate, first_step = bridge_rate(steps, args.device, model(), compile_=True)
            compile_seconds.append(first_step)
            return rate
        contenders["bridge compiled"] = compiled_bridge
    if args.trainer_compile:
        contenders["Trainer compiled"] = lambda: trainer_rate(steps, args.device, model(), Path(workdir), True)
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    with tempfile.TemporaryDirectory(prefix="bench_torch_user_model_") as workdir:
        for round_index in range(args.rounds):  # interleaved: a burst of outside load hits one round of each
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                rates[name].append(contenders[name]())

    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps, GPT-2 {args.layers} layers x {args.width}, "
          f"batch {args.batch} x {args.seq_len} tokens")
    for name, values in rates.items():
        print(f"{name:15s} steps/s median {statistics.median(values):7.1f}   rounds {[round(r, 1) for r in values]}")
    if compile_seconds:
        print(f"bridge compiled: first step (compilation) {[round(s, 1) for s in compile_seconds]} s "
              f"(later rounds reuse torch's compile caches)")
    for name in [name for name in names if name != "Trainer"]:
        ratios = [b / t for b, t in zip(rates[name], rates["Trainer"])]
        ratio = statistics.median(ratios)
        print(f"{name} / Trainer = {ratio:.2f}  (target >= 1.20; median of the per-round ratios "
              f"{[round(r, 2) for r in ratios]})")
    checked = rates["bridge" if args.no_compile else "bridge compiled"]
    ratio = statistics.median(b / t for b, t in zip(checked, rates["Trainer"]))
    return 1 if args.check and ratio < 1.2 else 0


if __name__ == "__main__":
    raise SystemExit(main())
