"""Train a `transformers` GPT-2 with functrain's loop (``backend: torch``): nothing downloaded, no registration.

The model is ``GPT2LMHeadModel`` built from a small ``GPT2Config``; its tied embedding and head stay tied. The
loop gives it what it gives its own models: the data order as a function of (seed, position), checkpoints
that a killed run resumes from bit for bit (dropout included), metrics.jsonl, callbacks. Without a
``loss_fn``, the loss is the built-in causal-LM loss of the model's ``.logits`` on ``tokens``; pass
``loss_fn=(model, batch, generator) -> (loss_sum, weight_sum, aux_sums)`` to use your own.

    python examples/torch_transformers_gpt2.py [--run-dir runs/gpt2_torch] [--steps 200] [--every 50]

Run it again with the same arguments and it resumes from the newest checkpoint.
"""

import argparse

from transformers import GPT2Config, GPT2LMHeadModel

import functrain
from torch_bridge.user_model import build_module

SEQ_LEN = 32


def build_gpt2(layers: int = 2, width: int = 64, heads: int = 2) -> GPT2LMHeadModel:
    """A GPT-2 over bytes (vocabulary 256), small enough for a CPU."""
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=width, n_layer=layers,
                                      n_head=heads, bos_token_id=0, eos_token_id=0))


def config(run_dir: str, steps: int, every: int) -> dict:
    """The run: bundled text as bytes, AdamW with warmup and cosine decay, checkpoints every ``every`` steps.

    The ``model`` section only describes the data's vocabulary and context to the config checks; the
    module passed to ``fit`` is what trains.
    """
    return {
        "seed": 0, "backend": "torch", "run": {"dir": run_dir},
        "model": {"name": "gpt", "vocab_size": 256, "max_len": SEQ_LEN},
        "data": {"name": "char_text", "seq_len": SEQ_LEN, "global_batch_size": 16, "eval_fraction": 0.05,
                 "prefetch": 0},
        "optimizer": {"name": "adamw", "learning_rate": 3e-3, "weight_decay": 0.01, "schedule": "cosine",
                      "warmup_steps": 10},
        "train": {"max_steps": steps, "clip_norm": 1.0},
        "checkpoint": {"every_steps": every, "keep": 2},
        "log": {"every_steps": 10, "progress": False, "tensorboard": False},
        "eval": {"every_steps": 0, "max_batches": 4},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/gpt2_torch")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50, help="checkpoint interval in steps")
    args = parser.parse_args()
    # Seeded construction: every run of this script starts from the same weights.
    model = build_module(build_gpt2, seed=0)
    result = functrain.fit(config(args.run_dir, args.steps, args.every), model=model)
    print(f"step {result.step}: train loss {result.metrics['train']['loss']:.3f}, "
          f"eval loss {result.metrics['eval']['loss']:.3f} ({result.stop_reason})")


if __name__ == "__main__":
    main()
