"""Benchmark the torch bridge against a plain PyTorch loop and transformers.Trainer, in one run.

All three train the same digits MLP (64 -> 128 -> 128 -> 10) on the same batches (64 rows, gathered from
the numpy dataset every step) with AdamW, weight decay, global-norm clipping at 1.0 and a constant rate:

- bridge:  ``TorchBackend.train_call`` (host batch -> tensors -> pure step -> metrics), the loop's path;
- plain:   ``zero_grad(); loss.backward(); clip_grad_norm_(); opt.step()`` with torch.optim.AdamW;
- Trainer: ``transformers.Trainer.train()`` with the equivalent TrainingArguments.

Each round runs all three, one after the other (bridge and plain take turns going first), and each ratio
is the median of the per-round ratios, so load from other processes on a shared machine hits the
contenders alike. Every rate is a steady state: timed from the 10th step (Trainer's by a callback, so its
start-up is not counted against it).

    python bench/bench_torch.py [--rounds 5] [--steps 300] [--device cpu|cuda] [--threads 1] [--check]

``--check`` exits 1 unless bridge/plain >= 0.9 and bridge/Trainer >= 1.2.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from functrain.config.load import load_config
from functrain.run.backends import torch_backend as make_backend
from torch_bridge.models import MLP

REPO = Path(__file__).resolve().parents[1]
BATCH, LR, WEIGHT_DECAY, CLIP = 64, 3e-3, 1e-4, 1.0


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, features in [0, 1]."""
    from sklearn.datasets import load_digits
    data = load_digits()
    return (data.data / 16.0).astype(np.float32), data.target.astype(np.int32)


def batch_rows(steps: int, num_records: int) -> list[np.ndarray]:
    """The row indices of every step's batch (the same for every contender)."""
    rng = np.random.default_rng(0)
    return [rng.choice(num_records, BATCH, replace=False) for _ in range(steps)]


def host_batch(x: np.ndarray, y: np.ndarray, rows: np.ndarray) -> dict[str, np.ndarray]:
    return {"x": x[rows], "y": y[rows], "weight": np.ones(len(rows), np.float32)}


def bridge_rate(x, y, rows, device: str) -> float:
    """Steps per second of the bridge's train call, one step per call (the most per-call overhead)."""
    config = load_config(REPO / "configs" / "mlp_digits_torch.yaml", [
        "train.epochs=null", f"train.max_steps={len(rows)}", "optimizer.schedule=constant",
        "optimizer.warmup_steps=0", f"optimizer.learning_rate={LR}", f"optimizer.weight_decay={WEIGHT_DECAY}",
        f"train.clip_norm={CLIP}", "train.steps_per_call=1", "log.every_steps=1", "eval.every_steps=0",
        "checkpoint.every_steps=0"])
    backend = make_backend(config, host_batch(x, y, rows[0]), len(rows))
    state = backend.init_state()
    start = None
    for index, step_rows in enumerate(rows):
        if index == 10:
            _sync(device)
            start = time.perf_counter()
        batch = {key: value[None] for key, value in host_batch(x, y, step_rows).items()}
        state, metrics = backend.train_call(state, batch)
    backend.to_host(metrics)
    return (len(rows) - 10) / (time.perf_counter() - start)


def _model(device: str) -> MLP:
    model = MLP(64, [128, 128], 10)
    model.reset_parameters(torch.Generator().manual_seed(0))
    return model.to(device)


def plain_rate(x, y, rows, device: str) -> float:
    """Steps per second of the textbook loop: backward, clip, optimizer step."""
    model = _model(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR)
    start = None
    for index, step_rows in enumerate(rows):
        if index == 10:
            _sync(device)
            start = time.perf_counter()
        batch = {key: torch.from_numpy(value).to(device) for key, value in host_batch(x, y, step_rows).items()}
        optimizer.zero_grad(set_to_none=True)
        losses = torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"].long(), reduction="none")
        loss = (losses * batch["weight"]).sum() / batch["weight"].sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
    _sync(device)
    return (len(rows) - 10) / (time.perf_counter() - start)


def trainer_rate(x, y, rows, device: str, workdir: Path) -> float:
    """Steady-state steps per second of transformers.Trainer on the same batches."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class Batches(torch.utils.data.Dataset):
        """The benchmark's batches, flattened into examples in order (Trainer re-batches them)."""
        def __init__(self):
            self.order = np.concatenate(rows)

        def __len__(self):
            return len(self.order)

        def __getitem__(self, index):
            row = self.order[index]
            return {"x": torch.from_numpy(x[row]), "labels": torch.tensor(int(y[row]))}

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _model("cpu")

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.mlp(x), labels)}

    class StepClock(TrainerCallback):
        times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            StepClock.times.append(time.perf_counter())

    StepClock.times = []
    args = TrainingArguments(
        output_dir=str(workdir), per_device_train_batch_size=BATCH, max_steps=len(rows), learning_rate=LR,
        weight_decay=WEIGHT_DECAY, max_grad_norm=CLIP, lr_scheduler_type="constant", warmup_steps=0,
        logging_steps=10**9, save_strategy="no", report_to=[], disable_tqdm=True, use_cpu=device == "cpu",
        dataloader_num_workers=0, seed=0)
    trainer = Trainer(model=Classifier(), args=args, train_dataset=Batches(), callbacks=[StepClock()])
    trainer.remove_callback(PrinterCallback)  # keep the benchmark's output to its own table
    trainer.train()
    clock = StepClock.times
    return (len(clock) - 10) / (clock[-1] - clock[9])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads for all contenders (1: a tiny model gains nothing from more, "
                             "and on a shared machine idle-spinning thread pools swamp the measurement)")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the ratios meet the targets")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    x, y = digits()
    rows = batch_rows(args.steps, len(y))
    bridge, plain, trainer = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_torch_") as workdir:
        for round_index in range(args.rounds):  # interleaved: a burst of outside load hits one round of each
            first, second = (bridge_rate, plain_rate) if round_index % 2 == 0 else (plain_rate, bridge_rate)
            rates = {first: first(x, y, rows, args.device), second: second(x, y, rows, args.device)}
            bridge.append(rates[bridge_rate])
            plain.append(rates[plain_rate])
            trainer.append(trainer_rate(x, y, rows, args.device, Path(workdir)))

    vs_plain = statistics.median(b / p for b, p in zip(bridge, plain))
    vs_trainer = statistics.median(b / t for b, t in zip(bridge, trainer))
    print(f"device {args.device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} rounds x {args.steps} steps, batch {BATCH}")
    for name, rates in (("bridge", bridge), ("plain", plain), ("Trainer", trainer)):
        print(f"{name:8s} steps/s median {statistics.median(rates):8.1f}   rounds {[round(r) for r in rates]}")
    print(f"bridge / plain   = {vs_plain:.2f}  (target >= 0.90; median of per-round ratios)")
    print(f"bridge / Trainer = {vs_trainer:.2f}  (target >= 1.20; median of per-round ratios)")
    if args.check and (vs_plain < 0.9 or vs_trainer < 1.2):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
