"""Run-directory conversion behind ``functrain convert``.

``hf_to_run_dir`` turns an HF directory into a step-0 functrain checkpoint (params + meta, no optimizer
state, so ``functrain train`` starts a fresh optimizer from it) plus a ``config.yaml`` to fine-tune from; given a
quantized base (``model.lora.base_dtype``: QLoRA) it quantizes each Dense kernel as it streams in, on the host's
CPU, so no more than one float tensor of the model is held at a time. ``run_dir_to_hf`` exports a run's
checkpoint back to an HF directory.
"""

import os
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import yaml

from functrain.checkpoint import load_params_and_meta
from functrain.errors import CheckpointError
from functrain.models import build_model, model_config_class
from functrain.models.configs.lora import LoraConfig
from functrain.models.head import HEAD_MODULES
from functrain.models.lora import adapter_paths, merged_params
from functrain.models.quantized import (
    dense_layers,
    dequantized_params,
    frozen_kernel_paths,
    has_quantized,
    quantize_kernel,
)
from functrain.models.stacking import unstack_layers
from torch_bridge.hf import run_store
from torch_bridge.hf.architectures import exported_architecture
from torch_bridge.hf.peft_adapter import write_adapter_dir
from torch_bridge.hf.pretrained import Place, model_config_of, read_params, save_pretrained


def _to_float32(path: Any, array: np.ndarray) -> np.ndarray:
    # Training keeps float32 master params; widening bf16/f16 is exact.
    return array if array.dtype == np.float32 else array.astype(np.float32)


def finetune_config(model: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """A run config that fine-tunes the converted model in ``run_dir`` (edit data.* for your corpus)."""
    max_len = model.get("n_positions") or model.get("max_position_embeddings") or 128
    # The bundled byte-level text fits any vocabulary of 256 tokens or more; a smaller one needs the user's
    # tokenised corpus (training then asks for data.path).
    data_name = "char_text" if int(model.get("vocab_size", 0)) >= 256 else "array_file"
    return {
        "seed": 0,
        "run": {"dir": run_dir},
        "model": model,
        "data": {"name": data_name, "seq_len": min(128, int(max_len) - 1), "global_batch_size": 8},
        "optimizer": {
            "name": "adamw",
            "learning_rate": 3e-5,
            "weight_decay": 0.0,
            "schedule": "constant",
            "warmup_steps": 0,
        },
        "train": {"max_steps": 100},
        "checkpoint": {"every_steps": 0, "resume": "auto"},
    }


def _quantizing(config: Any, lora: LoraConfig) -> Place:
    """A ``place`` quantizing the kernels a ``lora.base_dtype`` base stores quantized (on the host's CPU, one
    tensor at a time; the others widened to float32); the model's layers that cannot be are named first."""
    module = build_model(config.model_copy(update={"scan_layers": False}))

    def init(rng: jax.Array) -> tuple[Any, Any]:
        return nn.meta.unbox(module.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]), {}

    abstract, dense = dense_layers(init, jax.random.PRNGKey(0))
    frozen = {path + ("kernel",) for path in frozen_kernel_paths(abstract, dense, HEAD_MODULES, lora)}
    cpu = jax.devices("cpu")[0]
    quantize = jax.jit(quantize_kernel, static_argnums=(1, 2, 3))

    def place(path: Any, array: np.ndarray) -> Any:
        if path not in frozen:
            return _to_float32(path, array)
        with jax.default_device(cpu):
            state = quantize(jnp.asarray(array, jnp.float32), lora.base_dtype, lora.block_size, lora.double_quant)
        return {key: np.asarray(value) for key, value in state.items()}

    return place


def hf_to_run_dir(hf_dir: str, run_dir: str, quantized_base: LoraConfig | None = None) -> int:
    """Convert HF_DIR into a step-0 checkpoint at RUN_DIR/checkpoints/0 and write RUN_DIR/config.yaml.

    ``quantized_base``: a ``model.lora`` section with ``base_dtype``: the Dense kernels are stored quantized as it
    says (a QLoRA base), and the config fine-tunes them with those adapters. Everything is read and checked
    before anything is written. Returns the checkpoint step (0).
    """
    run = Path(run_dir).resolve()
    if run_store.has_checkpoints(run):
        raise CheckpointError(f"{run} already holds checkpoints; convert into a new run directory")
    if (run / "config.yaml").exists():
        raise CheckpointError(f"{run / 'config.yaml'} already exists; convert into a new run directory")
    place: Place = _to_float32
    if quantized_base is not None:
        place = _quantizing(model_config_of(hf_dir)[2].model_copy(update={"lora": quantized_base}), quantized_base)
    params, config = read_params(hf_dir, place=place)
    model = config.model_copy(update={"lora": quantized_base}).model_dump(mode="json")
    # Checkpointer.save adds format_version, step, time and package versions; no data position yet:
    # training starts at 0.
    meta = {
        "epoch": 0,
        "samples_consumed": 0,
        "global_batch_size": None,
        "global_batch_sizes": [],
        "num_records": None,
        "data_seed": None,
        "config_digest": None,
        "model": model,
        "metrics": {},
        "best_metric": None,
        "backend": "jax",
        "converted_from": str(Path(hf_dir).resolve()),
    }
    run.mkdir(parents=True, exist_ok=True)
    run_store.save(run, 0, params, meta)
    header = (
        f"# Written by `functrain convert hf-to-functrain` from {Path(hf_dir).resolve()}.\n"
        "# Fine-tune with `functrain train <this file>`. data.name=char_text feeds raw bytes (token ids\n"
        '# 0-255, needs vocab_size >= 256); for real work tokenise your corpus into an .npz of "tokens"\n'
        "# [records, seq_len + 1] and set data.name=array_file data.path=FILE.\n"
    )
    config_text = yaml.safe_dump(finetune_config(model, str(run)), sort_keys=False)
    (run / "config.yaml").write_text(header + config_text)
    return 0


def run_dir_to_hf(run_dir: str, out_dir: str, step: int | None, merge_lora: bool = False) -> str:
    """Export RUN_DIR's checkpoint at ``step`` (default: the latest) to OUT_DIR as an HF directory.

    A LoRA run exports its adapters as a PEFT adapter directory, or with ``merge_lora`` the base weights
    with the adapters merged in (``kernel + alpha / rank * lora_a @ lora_b``) as a plain HF directory. A QLoRA
    base is dequantized (float32) for a merged or plain export; its adapters' PEFT directory loads on the
    original HF base (quantized by bitsandbytes or not) as any LoRA adapter does.
    """
    params, meta = load_params_and_meta(Path(run_dir).resolve(), step)
    params = dict(unstack_layers(params))  # model.scan_layers: one adapter, one HF tensor per layer
    model = dict(meta.get("model") or {})
    name = model.get("name")
    arch = exported_architecture(name, f"{run_dir}: model {name!r} cannot be exported to HF")
    config: Any = model_config_class(arch.family)(**model)  # a converted family's: it has ``lora``
    has_adapters = bool(adapter_paths(params))
    if has_quantized(params) and (merge_lora or not has_adapters):  # the plain model's weights: the QLoRA base's
        params = dequantized_params(params)
    if merge_lora and not has_adapters:
        raise CheckpointError(f"{run_dir}: --merge-lora given but the checkpoint has no LoRA adapters; drop it")
    if has_adapters and not merge_lora:
        return write_adapter_dir(params, config, arch, os.fspath(out_dir), meta.get("converted_from"))
    if has_adapters:
        params = merged_params(params, config.lora.scale)
    return save_pretrained(params, config, os.fspath(out_dir))
