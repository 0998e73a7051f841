"""Benchmark: one GRPO step (rollouts + update) of functrain against TRL 1.16's GRPOTrainer, on CPU.

The same tiny transformers Llama (saved as an HF directory, converted with ``functrain convert hf-to-functrain``),
the same prompts, ``G`` completions per prompt of up to ``C`` tokens sampled at temperature 1 by each trainer's own
sampler (TRL: ``model.generate``, no vLLM; functrain: the in-process KV-cache decoder of the experience stage), the
same reward function, ``loss_type: dapo``, ``beta: 0``, AdamW, float32, one update per generation. Each trainer
runs ``--warmup`` steps (compilation, allocation) and then ``--steps`` timed steps; the step time is the median
of the timed steps, and the sampling share is the time spent drawing completions over the step time (TRL's
``_generate_single_turn``, functrain's ``draw``, each timed from outside). Each trainer runs in a process of its
own, the two alternating ``--repeats`` times; the ratio is the median of the paired ratios. Beside the wall-clock
time, each process's CPU time a step (all its threads) is compared: on a machine that other jobs share it moves less
than the wall-clock time, and for a trainer on one thread it is what the step would take on an idle core (a trainer
whose threads spin while they wait, as torch's OpenMP threads do, is counted for its spinning too).

With ``--async-steps K`` (default 1; 0: not measured) each repeat also runs functrain's asynchronous GRPO
(``grpo.async_steps: K``: the next K steps' batches sampled and scored while a step trains) in a process of its
own, and prints its step time against the synchronous run's of the same repeat (the median of the paired ratios).

    python bench/bench_grpo.py [--layers 2] [--hidden 64] [--prompts 4] [--generations 8] [--prompt-len 16]
                               [--completion-len 32] [--warmup 2] [--steps 6] [--repeats 3] [--trl-threads 0]
                               [--no-share-prompt] [--batch-invariant] [--async-steps 1]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REWARD = """
def length(completions, **kwargs):
    return [float(len(text)) for text in completions]
"""


def char_tokenizer(directory: Path):
    """A character-level fast tokenizer with an EOS token (no download)."""
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(["<pad>", "<unk>", "</s>", *string.printable])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("</s>|."), behavior="isolated")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="</s>"
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def cpu_seconds() -> float:
    """The process's CPU time so far (all its threads, user and system)."""
    times = os.times()
    return times.user + times.system


class StepClock:
    """Wall-clock time of each step and of the sampling inside it, and the process's CPU time of each step."""

    def __init__(self) -> None:
        self.ends: list[float] = [time.perf_counter()]
        self.cpu_ends: list[float] = [cpu_seconds()]
        self.sampling: list[float] = []

    def start(self) -> None:
        self.ends, self.cpu_ends = [time.perf_counter()], [cpu_seconds()]

    def step_done(self) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(cpu_seconds())

    def timed(self, function):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.sampling.append(time.perf_counter() - start)

        return wrapper

    def report(self, warmup: int, lengths: list[float]) -> tuple[float, float, float, float]:
        """(median step seconds, median sampling share, mean completion length, CPU seconds a step) of the steps
        after ``warmup``."""
        steps = [b - a for a, b in zip(self.ends, self.ends[1:])][warmup:]
        shares = [s / t for s, t in zip(self.sampling[warmup:], steps)]
        cpu = (self.cpu_ends[-1] - self.cpu_ends[warmup]) / len(steps)  # os.times ticks are 10 ms: a mean
        return statistics.median(steps), statistics.median(shares), statistics.mean(lengths[warmup:]), cpu


def trl_step(root: Path, tokenizer, args) -> tuple[float, float, float]:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(root))
    import bench_grpo_reward

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    clock = StepClock()

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_, **__):
            clock.step_done()

    torch.manual_seed(0)
    config = GRPOConfig(
        output_dir=str(root / "trl_out"),
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations,
        max_completion_length=args.completion_len,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        bf16=False,
        disable_tqdm=True,
        gradient_checkpointing=False,
        temperature=1.0,
        beta=0.0,
        loss_type="dapo",
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf")
    prompts = [json.loads(line) for line in (root / "prompts.jsonl").read_text().splitlines()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[bench_grpo_reward.length],
        args=config,
        train_dataset=Dataset.from_list(prompts),
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    trainer._generate_single_turn = clock.timed(trainer._generate_single_turn)
    clock.start()
    trainer.train()
    lengths = [
        entry["completions/mean_length"] for entry in trainer.state.log_history if "completions/mean_length" in entry
    ]
    return clock.report(args.warmup, lengths)


def functrain_step(root: Path, args, async_steps: int = 0) -> tuple[float, float, float]:
    import functrain
    from functrain.callbacks.base import Callback
    from functrain.tasks.grpo import rollout

    clock = StepClock()

    class Clock(Callback):
        def on_step_end(self, view) -> None:
            clock.step_done()

    rollout.draw = clock.timed(rollout.draw)
    run = root / "functrain_run"
    shutil.rmtree(run, ignore_errors=True)  # an earlier repeat's
    shutil.copytree(root / "converted", run)
    overrides = {
        "run.dir": str(run),
        "data.name": "prompts",
        "data.path": str(root / "prompts.jsonl"),
        "data.tokenizer": str(root / "tok"),
        "data.seq_len": 16,
        "data.global_batch_size": args.prompts * args.generations,
        "grpo.num_generations": args.generations,
        "grpo.max_completion_length": args.completion_len,
        "grpo.temperature": 1.0,
        "grpo.beta": 0.0,
        "grpo.loss_type": "dapo",
        "grpo.reward_funcs": [f"{root / 'bench_grpo_reward.py'}:length"],
        "optimizer.learning_rate": 1e-5,
        "optimizer.schedule": "constant",
        "train.max_steps": args.warmup + args.steps,
        "train.steps_per_call": 1,
        "log.every_steps": 1,
        "log.progress": False,
        "log.tensorboard": False,
        "log.plot": False,
        "checkpoint.every_steps": 0,
        "checkpoint.async_save": False,
        "grpo.share_prompt": not args.no_share_prompt,
        "model.batch_invariant": args.batch_invariant,
        "grpo.async_steps": async_steps,
    }
    clock.start()
    functrain.fit(str(run / "config.yaml"), callbacks=[Clock()], **overrides)
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lengths = [line["completions/mean_length"] for line in lines if line["split"] == "train"]
    return clock.report(args.warmup, lengths)


def prepare(root: Path, args) -> None:
    """The HF model, its conversion, the tokenizer, the prompts and the reward function under ``root``."""
    import torch
    import transformers

    from functrain.commands.cli import main as cli

    tokenizer = char_tokenizer(root / "tok")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.hidden,
            intermediate_size=args.hidden * 4,
            num_hidden_layers=args.layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.prompt_len + args.completion_len,
            bos_token_id=2,
            eos_token_id=2,
            pad_token_id=0,
        )
    ).save_pretrained(root / "hf")
    assert cli(["convert", "hf-to-functrain", str(root / "hf"), str(root / "converted")]) == 0
    rng = random.Random(0)
    (root / "prompts.jsonl").write_text(
        "".join(
            json.dumps({"prompt": "".join(rng.choices(string.ascii_lowercase, k=args.prompt_len))}) + "\n"
            for _ in range(args.prompts * (args.warmup + args.steps))
        )
    )
    (root / "bench_grpo_reward.py").write_text(REWARD)


def worker(which: str, root: Path, args) -> None:
    """One trainer's measurement, in a process of its own, printed as JSON."""
    import transformers

    if which == "functrain":
        result = functrain_step(root, args)
    elif which == "functrain_async":
        result = functrain_step(root, args, args.async_steps)
    else:
        result = trl_step(root, transformers.AutoTokenizer.from_pretrained(root / "tok"), args)
    print("RESULT " + json.dumps(dict(zip(("step", "share", "length", "cpu"), result))))


def measured(which: str, root: Path, argv: list[str]) -> dict:
    command = [sys.executable, __file__, *argv, "--worker", which, "--root", str(root)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the {which} run failed:\n" + "\n".join(done.stderr.splitlines()[-15:]))
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trl-threads", type=int, default=0, help="torch threads of TRL's process (0: torch's)")
    parser.add_argument("--no-share-prompt", action="store_true", help="functrain: grpo.share_prompt=false")
    parser.add_argument("--batch-invariant", action="store_true", help="functrain: model.batch_invariant=true")
    parser.add_argument("--async-steps", type=int, default=1, help="functrain: also grpo.async_steps=K (0: not run)")
    parser.add_argument("--worker", choices=("functrain", "functrain_async", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.root), args)
        return
    argv = [arg for arg in sys.argv[1:]]
    with tempfile.TemporaryDirectory(prefix="bench-grpo-") as tmp:
        root = Path(tmp)
        prepare(root, args)
        runs = []
        trainers = ("functrain", "trl", *(("functrain_async",) if args.async_steps else ()))
        for _ in range(args.repeats):  # interleaved, each trainer in a fresh process
            runs.append({which: measured(which, root, argv) for which in trainers})
    rows = args.prompts * args.generations
    print(
        f"GRPO step, Llama {args.layers} layers x {args.hidden}, {args.prompts} prompts x {args.generations} "
        f"completions ({rows} rows), prompt {args.prompt_len} + completion {args.completion_len} tokens, CPU fp32, "
        f"median of {args.repeats} interleaved runs of {args.steps} steps"
    )
    names = [("functrain", "functrain"), ("trl", "TRL 1.16")]
    names += [("functrain_async", f"functrain async_steps={args.async_steps}")] if args.async_steps else []
    for which, name in names:
        step = statistics.median(run[which]["step"] for run in runs)
        share = statistics.median(run[which]["share"] for run in runs)
        length = statistics.mean(run[which]["length"] for run in runs)
        cpu = statistics.median(run[which]["cpu"] for run in runs)
        print(
            f"  {name:24} {step * 1000:8.1f} ms/step, sampling {share:.0%} of it, completions {length:.1f} tokens; "
            f"CPU {cpu * 1000:.1f} ms/step"
        )
    for measure, what in (("step", "wall-clock"), ("cpu", "CPU time")):
        ratios = [run["trl"][measure] / run["functrain"][measure] for run in runs]
        runs_text = ", ".join(f"{ratio:.2f}" for ratio in ratios)
        print(f"  {what}: functrain is {statistics.median(ratios):.2f}x faster (runs: {runs_text})")
    if args.async_steps:  # the same repeat's synchronous run: steps per second, asynchronous over synchronous
        for measure, what in (("step", "wall-clock"), ("cpu", "CPU time")):
            ratios = [run["functrain"][measure] / run["functrain_async"][measure] for run in runs]
            runs_text = ", ".join(f"{ratio:.2f}" for ratio in ratios)
            print(f"  {what}: async/sync throughput {statistics.median(ratios):.2f}x (runs: {runs_text})")


if __name__ == "__main__":
    main()
