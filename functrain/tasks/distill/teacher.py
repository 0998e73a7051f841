"""The frozen teacher of a distillation run: a functrain run directory or an HF checkpoint directory.

:func:`open_teacher` reads what the program is built from (the teacher's model config and its Flax module, whose
pieces give the logical axes of its params) without reading any weights, and :func:`check_teacher` checks it
against the student's vocabulary and the data's windows;
``Teacher.load_params()`` reads them (numpy), which a fresh start does once: a resumed run restores them with
its own state. A run directory gives its ``config.yaml`` model section and its newest whole checkpoint (or
``distill.teacher_step``), LoRA adapters merged in; an HF directory (config.json + safetensors of a supported
architecture) is read by :mod:`torch_bridge.hf`, imported only then (functrain does not need torch otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp
import pydantic
import yaml

from functrain.checkpoint import load_params
from functrain.checkpoint.layout import CHECKPOINTS_SUBDIR, committed_steps
from functrain.core.yaml_text import load_yaml
from functrain.errors import ConfigError
from functrain.models import build_model, is_language_model, model_config_class

HF_CONFIG = "config.json"


@dataclass(frozen=True)
class Teacher:
    """A teacher model: ``config`` (its validated model config), ``module`` (its Flax module) and
    ``load_params()`` (its weights as numpy arrays, read when called)."""

    source: Path
    config: Any
    module: nn.Module
    load_params: Callable[[], Any]


def _run_dir_model(run_dir: Path, step: int | None) -> tuple[Any, Callable[[], Any]]:
    """The model config of a functrain run directory and its params loader."""
    if not committed_steps(run_dir / CHECKPOINTS_SUBDIR):
        raise ConfigError(
            f"distill.teacher={run_dir} holds no checkpoint (no committed step under "
            f"{CHECKPOINTS_SUBDIR}/, and no {HF_CONFIG} of an HF model); train the teacher first or "
            f"point distill.teacher at a trained run or an HF checkpoint directory"
        )
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        raise ConfigError(
            f"distill.teacher={run_dir} has checkpoints but no config.yaml naming its model; point "
            f"distill.teacher at a run directory that functrain train or convert wrote"
        )
    try:
        section = (load_yaml(config_file.read_text()) or {}).get("model")
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise ConfigError(f"the teacher's {config_file} is not valid YAML: {problem}; fix the file") from None
    if not isinstance(section, dict) or "name" not in section:
        raise ConfigError(
            f"the teacher {run_dir} is not a registry model (its config.yaml has no model.name); a "
            f"teacher must be one of functrain's models, trained or converted from HF"
        )
    try:
        config = model_config_class(section["name"]).model_validate(section)
    except ValueError as exc:  # an unknown model name, or a pydantic ValidationError
        detail = exc.errors()[0]["msg"] if isinstance(exc, pydantic.ValidationError) else str(exc)
        raise ConfigError(
            f"the model section of {config_file} is not valid here ({detail}); point "
            f"distill.teacher at a run of this functrain version"
        ) from None
    if not is_language_model(config.name):
        raise ConfigError(
            f"the teacher {run_dir} is model {section['name']!r}, not a language model; distill from a causal LM"
        )

    def load() -> Any:
        from functrain.models.lora import merged_for_inference  # a LoRA teacher: its adapters merged in

        return merged_for_inference(load_params(run_dir, step), config)

    return config, load


def _hf_model(hf_dir: Path) -> tuple[Any, Callable[[], Any]]:
    """The model config of an HF checkpoint directory and its params loader."""
    try:
        from torch_bridge.hf.pretrained import architecture_for, read_params
        from torch_bridge.hf.reader import find_weights, read_config
    except ImportError as exc:
        raise ConfigError(
            f"an HF teacher is read with PyTorch and safetensors ({exc}); pip install "
            f"'functrain[hf]', or convert it elsewhere with functrain convert hf-to-functrain"
        ) from None
    hf_config = read_config(hf_dir)
    config = architecture_for(hf_config).model.from_hf_config(hf_config)
    find_weights(hf_dir)  # no weights file: refused now, not at the first step
    return config, lambda: read_params(hf_dir)[0]


def open_teacher(path: str, *, step: int | None = None, dtype: Any = jnp.float32) -> Teacher:
    """The teacher at ``path`` (a functrain run directory, or an HF directory), computing in ``dtype``;
    ``step``: a run directory's checkpoint (None: the newest whole one)."""
    source = Path(path).absolute()
    if not source.is_dir():
        raise ConfigError(
            f"distill.teacher={path} is not a directory; point it at a functrain run directory or "
            f"an HF checkpoint directory"
        )
    if (source / CHECKPOINTS_SUBDIR).is_dir() or not (source / HF_CONFIG).is_file():
        config, load = _run_dir_model(source, step)
    elif step is not None:
        raise ConfigError(
            f"distill.teacher_step picks a checkpoint of a run directory and {path} is an HF "
            f"directory; remove distill.teacher_step"
        )
    else:
        config, load = _hf_model(source)
    return Teacher(source, config, build_model(config, dtype), load)


def check_teacher(teacher: Teacher, *, vocab_size: int, positions: int) -> None:
    """The teacher must predict the student's tokens (``vocab_size``: the student's logits') over the data's
    windows (``positions``: the inputs' length)."""
    teacher_vocab_size = teacher.config.vocabulary_size()
    if teacher_vocab_size != vocab_size:
        raise ConfigError(
            f"the teacher {teacher.source} has a vocabulary of {teacher_vocab_size} tokens and the "
            f"student {vocab_size}; distill.teacher must share the student's tokenizer and vocabulary "
            f"size"
        )
    context = teacher.config.max_positions()
    if context is not None and context < positions:
        raise ConfigError(
            f"the teacher {teacher.source} attends over {context} positions and the data's windows "
            f"have {positions}; lower data.seq_len or distil from a teacher with a longer context"
        )
