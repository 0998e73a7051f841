"""Bitwise-reproducible training on GPUs: ``train.deterministic`` (default true).

A resumed run equals the uninterrupted one bit for bit only if the same program gives the same bits each time it
runs. XLA's CPU and TPU programs do. XLA's GPU programs do not by default: scatter-adds (an embedding's gradient),
some reductions and the GEMM and attention algorithms the autotuner picks accumulate in an order that can change
from one run or compile to the next. Seen on one H200 (jax 0.11.2): ``functrain verify-resume
configs/char_gpt.yaml`` failed at step 10, before any interruption (loss 4.7320967 vs 4.7320991), and passed
with XLA's ``xla_gpu_deterministic_ops``, which makes XLA choose deterministic implementations and kernels.

What that costs there: cuDNN's flash attention did not compile under it (an internal XLA error at the first
call of ``configs/gpt_350m.yaml``), so a deterministic GPU run's ``model.attention: auto`` is XLA's attention,
and ``cudnn`` is refused in one line. On ``gpt_350m`` (bf16, 16k tokens a step): 42.0% MFU with cuDNN and
XLA's default kernels, 18.0% deterministic with XLA's attention. ``train.deterministic: false`` trades bitwise
resume for that speed.
"""

from typing import Any

from functrain.errors import ConfigError

# XLA DebugOptions of a deterministic GPU program (passed as compile options, so no XLA_FLAGS and no restart).
GPU_DETERMINISTIC_OPTIONS = {"xla_gpu_deterministic_ops": True}


def step_compiler_options(
    platform: str, deterministic: bool, task_options: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The XLA options of a train step compiled for ``platform``: the task's, plus determinism on a GPU."""
    if not (deterministic and platform == "gpu"):
        return task_options
    return {**(task_options or {}), **GPU_DETERMINISTIC_OPTIONS}


def attention_choice(choice: str, platform: str, deterministic: bool) -> str:
    """``model.attention`` as a run on ``platform`` uses it: ``auto`` is XLA's attention on a deterministic GPU
    run (cuDNN's flash attention does not compile with deterministic ops); ``cudnn`` there is refused."""
    if not (deterministic and platform == "gpu"):
        return choice
    if choice == "cudnn":
        raise ConfigError(
            "model.attention=cudnn does not compile with deterministic GPU ops (train.deterministic, which "
            "bitwise resume needs); set train.deterministic=false or model.attention=auto"
        )
    return "xla" if choice == "auto" else choice
