"""Benchmark: convert a ≥1 GB sharded Llama-layout safetensors checkpoint into functrain params.

Writes random float32 tensors with numpy in a temporary directory (no network), then measures, each in a
fresh subprocess so peak RSS is the conversion's own:

- ``safetensors``: reading every tensor of every shard with safetensors alone (the throughput baseline);
- ``convert``: ``torch_bridge.hf.read_params`` (headers checked, names mapped, Linear weights transposed);
- ``to_run_dir``: ``hf_to_run_dir`` (convert plus the Orbax step-0 checkpoint write), which must fit the
  same budget (Orbax writes the numpy leaves in place, without its defensive deep copy).

Peak RSS is compared with the budget ``model bytes + 2 × largest tensor + interpreter baseline`` (the
baseline is the child's RSS after its imports, before any tensor is read; the peak is counted from there, as
the imports alone peak above where they settle and would otherwise hide the conversion's own peak).

    python bench/bench_hf_convert.py [--layers 18] [--shard-mb 300] [--repeats 2]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from torch_bridge.hf.writer import plan_shards  # noqa: E402

CHILD_PRELUDE = """
import json, re, sys, time
sys.path.insert(0, {repo!r})
import jax, ml_dtypes, numpy as np
from safetensors import safe_open
import torch_bridge.hf as hf
def status_kb(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))
# Imports peak above where they settle; restart the peak there (Linux: writing 5 to clear_refs resets VmHWM).
open("/proc/self/clear_refs", "w").write("5")
baseline_kb = status_kb("VmRSS")
"""

CHILD_SAFETENSORS = """
from pathlib import Path
start = time.perf_counter()
kept = {{}}
for file in sorted(Path({path!r}).glob("*.safetensors")):
    with safe_open(str(file), framework="np") as handle:
        for name in handle.keys():
            kept[name] = handle.get_tensor(name)
seconds = time.perf_counter() - start
"""

CHILD_CONVERT = """
start = time.perf_counter()
kept, config = hf.read_params({path!r})
seconds = time.perf_counter() - start
"""

CHILD_RUN_DIR = """
import tempfile
start = time.perf_counter()
with tempfile.TemporaryDirectory(dir={path!r}) as run_dir:
    hf.hf_to_run_dir({path!r}, run_dir + "/run")
    kept = {{}}
seconds = time.perf_counter() - start
"""

CHILD_REPORT = """
peak_kb = status_kb("VmHWM")
print(json.dumps({"seconds": seconds, "baseline_bytes": baseline_kb * 1024, "peak_bytes": peak_kb * 1024,
                  "leaves": len(jax.tree.leaves(kept))}))
"""


def llama_config(layers: int) -> dict:
    """A Llama config whose float32 weights exceed 1 GB with 18 layers."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
            "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": layers,
            "num_attention_heads": 16, "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu"}


def llama_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a LlamaForCausalLM with ``cfg``."""
    hidden, inner, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.self_attn.q_proj.weight": (hidden, hidden), f"{p}.self_attn.k_proj.weight": (kv, hidden),
                       f"{p}.self_attn.v_proj.weight": (kv, hidden), f"{p}.self_attn.o_proj.weight": (hidden, hidden),
                       f"{p}.mlp.gate_proj.weight": (inner, hidden), f"{p}.mlp.up_proj.weight": (inner, hidden),
                       f"{p}.mlp.down_proj.weight": (hidden, inner), f"{p}.input_layernorm.weight": (hidden,),
                       f"{p}.post_attention_layernorm.weight": (hidden,)})
    shapes.update({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    return shapes


def write_random_checkpoint(out: Path, config_json: dict, shapes: dict[str, tuple[int, ...]],
                            shard_bytes: int) -> tuple[int, int]:
    """Write config.json, random float32 shards of ``shapes`` and the index; return (model bytes, largest
    tensor bytes)."""
    from safetensors.numpy import save_file

    (out / "config.json").write_text(json.dumps(config_json))
    sizes = {name: int(np.prod(shape)) * 4 for name, shape in shapes.items()}
    groups = plan_shards(sizes, shard_bytes)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file_name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: rng.standard_normal(shapes[n], dtype=np.float32) for n in group}, str(out / file_name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file_name))
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(sizes.values()), max(sizes.values())


def write_checkpoint(out: Path, layers: int, shard_bytes: int) -> tuple[int, int]:
    """A Llama-layout checkpoint of ``layers`` layers; return (model bytes, largest tensor bytes)."""
    cfg = llama_config(layers)
    return write_random_checkpoint(out, cfg, llama_shapes(cfg), shard_bytes)


def run_child(body: str, path: Path) -> dict:
    code = textwrap.dedent(CHILD_PRELUDE.format(repo=str(REPO)) + body.format(path=str(path)) + CHILD_REPORT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    if proc.returncode:
        raise SystemExit(f"benchmark child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--shard-mb", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        path = Path(tmp)
        model_bytes, largest = write_checkpoint(path, args.layers, args.shard_mb * 10**6)
        shards = len(list(path.glob("*.safetensors")))
        print(f"checkpoint: {model_bytes / 1e9:.3f} GB in {shards} shards, largest tensor {largest / 1e6:.1f} MB")
        results = {"safetensors": [], "convert": [], "to_run_dir": []}
        for _ in range(args.repeats):  # interleaved so all see the same page-cache state
            results["safetensors"].append(run_child(CHILD_SAFETENSORS, path))
            results["convert"].append(run_child(CHILD_CONVERT, path))
        results["to_run_dir"].append(run_child(CHILD_RUN_DIR, path))
    for name, runs in results.items():
        best = min(runs, key=lambda r: r["seconds"])
        budget = model_bytes + 2 * largest + best["baseline_bytes"]
        print(f"{name:12s} {best['seconds']:6.2f} s  {model_bytes / best['seconds'] / 1e9:5.2f} GB/s  "
              f"peak RSS {best['peak_bytes'] / 1e9:.3f} GB (baseline {best['baseline_bytes'] / 1e9:.3f} GB)  "
              f"peak/budget {best['peak_bytes'] / budget:.3f}  leaves {best['leaves']}")
    convert = min(results["convert"], key=lambda r: r["seconds"])
    baseline = min(results["safetensors"], key=lambda r: r["seconds"])
    budget = model_bytes + 2 * largest + convert["baseline_bytes"]
    print(f"ratio convert peak RSS / budget (model + 2x largest + baseline): {convert['peak_bytes'] / budget:.3f}"
          f"  {'OK' if convert['peak_bytes'] <= budget else 'OVER BUDGET'}")
    run_dir = results["to_run_dir"][0]
    run_budget = model_bytes + 2 * largest + run_dir["baseline_bytes"]
    print(f"ratio to_run_dir peak RSS / budget (model + 2x largest + baseline): "
          f"{run_dir['peak_bytes'] / run_budget:.3f}  {'OK' if run_dir['peak_bytes'] <= run_budget else 'OVER BUDGET'}")
    print(f"ratio convert peak RSS above baseline / model bytes: "
          f"{(convert['peak_bytes'] - convert['baseline_bytes']) / model_bytes:.3f}")
    print(f"ratio convert peak RSS / safetensors-alone peak RSS: {convert['peak_bytes'] / baseline['peak_bytes']:.3f}")
    print(f"ratio convert throughput / safetensors-alone throughput: {baseline['seconds'] / convert['seconds']:.3f}")


if __name__ == "__main__":
    main()
