"""Write a functrain LoRA run's adapters as a PEFT adapter directory that ``peft`` loads onto the
``transformers`` base model: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT names a Linear's adapters ``base_model.model.<module>.lora_A.weight`` [rank, in] and ``lora_B.weight``
[out, rank] (torch layout: functrain's ``lora_a`` [in, rank] and ``lora_b`` [rank, out] transposed), and scales
their product by ``lora_alpha / r`` as functrain does. ``target_modules`` is a regular expression naming
exactly the adapted modules, so PEFT adds adapters nowhere else.
"""

import json
import os
import re
from typing import Any

import numpy as np
from flax.traverse_util import flatten_dict
from safetensors.numpy import save_file

from functrain.errors import CheckpointError
from functrain.models.lora import ADAPTER_A, ADAPTER_B, adapter_paths
from torch_bridge.hf import writer
from torch_bridge.hf.architectures import Architecture
from torch_bridge.hf.mappings import transpose_copy

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."


def hf_modules(arch: Architecture, config: Any, paths: list[tuple[str, ...]]) -> dict[tuple[str, ...], str]:
    """The HF module name of each adapted functrain projection (only plain ``nn.Linear`` ones map to PEFT)."""
    linear = {
        rule.paths[0][:-1]: rule.hf_name.removesuffix(".weight")
        for rule in arch.mapping.rules(config)
        if rule.kind == "transpose"
    }
    unmapped = ["/".join(path) for path in paths if path not in linear]
    if unmapped:
        raise CheckpointError(
            f"adapters on {', '.join(unmapped)} have no PEFT form for {arch.model_type} "
            f"(not an HF nn.Linear); export with --merge-lora"
        )
    return {path: linear[path] for path in paths}


def write_adapter_dir(
    params: Any, config: Any, arch: Architecture, out_dir: str | os.PathLike, base_model: str | None = None
) -> str:
    """Write the adapters in ``params`` (a LoRA run's params) to OUT_DIR in PEFT's format."""
    settings = config.lora
    paths = adapter_paths(params)
    modules = hf_modules(arch, config, paths)
    flat = flatten_dict(params)
    tensors = {}
    for path, module in modules.items():
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = transpose_copy(np.asarray(flat[path + (ADAPTER_A,)]))
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = transpose_copy(np.asarray(flat[path + (ADAPTER_B,)]))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": "^(" + "|".join(re.escape(m) for m in modules.values()) + ")$",
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    with writer.staged_directory(out_dir) as staging:
        save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
    return str(os.path.abspath(out_dir))
