"""HF-style checkpoints ⇄ functrain's Flax models (GPT-2, Llama), exact to float32 precision.

- `load_pretrained(path)` -> ``(apply_fn, params, config)``; `read_params(path, place)` for params only.
- `save_pretrained(params, config, out_dir, max_shard_size="5GB")` writes config.json + safetensors.
- `hf_to_run_dir` / `run_dir_to_hf` back ``functrain convert``.
"""

from torch_bridge.hf.convert import hf_to_run_dir, run_dir_to_hf
from torch_bridge.hf.pretrained import load_pretrained, place_with_shardings, read_params, save_pretrained

__all__ = [
    "hf_to_run_dir",
    "load_pretrained",
    "place_with_shardings",
    "read_params",
    "run_dir_to_hf",
    "save_pretrained",
]
