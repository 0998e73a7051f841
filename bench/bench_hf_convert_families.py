"""Benchmark: conversion peak RSS for every HF family stays within ``model + 2 × largest tensor``.

For each family (Llama, Qwen2, Qwen3, Mistral, Phi-3 with its fused ``qkv_proj`` / ``gate_up_proj``, Gemma 2,
Gemma 3, GPT-2) this writes a random float32 checkpoint of ~0.4 GB in that family's layout, with the tensor
names and shapes taken from the conversion tables (``torch_bridge.hf.mappings``; no transformers model is
built, only its config class for a complete config.json), and converts it with ``torch_bridge.hf.read_params``
in a fresh subprocess (see ``bench_hf_convert.py``). Printed per family: peak RSS / (interpreter baseline +
model bytes + 2 × largest tensor), and the stricter peak RSS above the baseline / (model + 2 × largest tensor).

    python bench/bench_hf_convert_families.py [--layers 8] [--families phi3 gpt2 ...]
"""

import argparse
import sys
import tempfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_hf_convert import CHILD_CONVERT, run_child, write_random_checkpoint  # noqa: E402
from torch_bridge.hf.architectures import architectures  # noqa: E402
from torch_bridge.hf.pretrained import expected_shapes  # noqa: E402

# hidden 768, 12 heads (4 KV heads), MLP 2048, vocab 32000: ~0.4 GB float32 with 8 layers and an untied head.
LLAMA_LIKE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=False)
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", {"head_dim": 64}),  # q/k norms
    "mistral": ("MistralConfig", {"sliding_window": 1024}),
    "phi3": ("Phi3Config", {"vocab_size": 32064}),  # fused qkv_proj and gate_up_proj, split on read
    "gemma2": ("Gemma2Config", {"head_dim": 64, "tie_word_embeddings": True}),
    "gemma3_text": ("Gemma3TextConfig", {"head_dim": 64, "tie_word_embeddings": True}),
    "gpt2": ("GPT2Config", {}),  # fused c_attn, split on read
}


def hf_config(family: str, layers: int) -> dict:
    """A complete config.json for ``family`` (defaults filled in by its transformers config class)."""
    import transformers

    class_name, extra = FAMILIES[family]
    if family == "gpt2":
        kwargs = dict(vocab_size=50257, n_embd=768, n_layer=layers, n_head=12, n_positions=1024)
    else:
        kwargs = {**LLAMA_LIKE, "num_hidden_layers": layers, **extra}
    config = getattr(transformers, class_name)(**kwargs).to_dict()
    config["model_type"] = family
    return config


def hf_shapes(config_json: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the family's checkpoint, from its conversion table."""
    arch = architectures()[config_json["model_type"]]
    config = arch.model.from_hf_config(config_json)
    leaves = expected_shapes(arch, config)
    return {rule.hf_name: rule.hf_shape(tuple(leaves[path] for path in rule.paths)) for rule in arch.mapping.rules(config)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard-mb", type=int, default=200)
    parser.add_argument("--families", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    print(f"{'family':12s} {'model GB':>8s} {'largest MB':>10s} {'baseline GB':>11s} {'peak GB':>7s} "
          f"{'seconds':>7s}  peak / (baseline + model + 2x largest)  (peak - baseline) / (model + 2x largest)")
    worst = 0.0
    for family in args.families:
        with tempfile.TemporaryDirectory(prefix=f"bench_hf_{family}_") as tmp:
            path = Path(tmp)
            config_json = hf_config(family, args.layers)
            model_bytes, largest = write_random_checkpoint(path, config_json, hf_shapes(config_json),
                                                           args.shard_mb * 10**6)
            result = run_child(CHILD_CONVERT, path)
        budget = result["baseline_bytes"] + model_bytes + 2 * largest
        ratio = result["peak_bytes"] / budget
        above = (result["peak_bytes"] - result["baseline_bytes"]) / (model_bytes + 2 * largest)
        worst = max(worst, ratio)
        print(f"{family:12s} {model_bytes / 1e9:8.3f} {largest / 1e6:10.1f} {result['baseline_bytes'] / 1e9:11.3f} "
              f"{result['peak_bytes'] / 1e9:7.3f} {result['seconds']:7.2f}  {ratio:.3f} "
              f"{'OK' if ratio <= 1 else 'OVER BUDGET':11s}  {above:.3f}", flush=True)
    print(f"ratio worst family peak RSS / budget: {worst:.3f}  {'OK' if worst <= 1 else 'OVER BUDGET'}")


if __name__ == "__main__":
    main()
