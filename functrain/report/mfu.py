"""Throughput in model terms: tokens per second, analytic training FLOPs per token, and model-FLOPs utilisation.

FLOPs per token of one training step (forward + backward = 3 x forward, a multiply-add counted as 2) for a
decoder-only transformer with L layers, width d, H query heads and K key/value heads of width h, MLP width f
(gated MLPs such as Llama's have 3 matrices, plain ones 2), vocabulary V and T tokens of context:

    matmuls     6 * (L * (d*H*h + 2*d*K*h + H*h*d + m*d*f + d*r) + d*V)   (m = 2 or 3; the head counted, tied or not)
    attention   6 * L * T * H*h   causal (QK^T and AV over the T/2 earlier positions on average)

Latent attention (DeepSeek-V3) replaces ``d*H*h + 2*d*K*h + H*h*d`` by its projections' parameters
(``DecoderShape.attention_params``: the low-rank query and key-value projections and the output) and ``H*h`` in
the attention term by ``H*(h + h_v)/2`` (queries and keys of width ``h``, values of ``h_v``).

A hybrid stack (Qwen3-Next, Qwen3.5) attends on ``DecoderShape.attention_layers`` of its layers (the attention term
counts those) and adds ``3 * DecoderShape.mixer_flops``, the forward FLOPs per token of its other layers' token
mixing (Gated DeltaNet: the chunked delta rule and the convolution), trained at 3 x their forward.

A mixture of experts counts its active parameters: f is the width of the k experts a token takes (plus its
shared experts'), r the router's outputs (0 for a dense model).

Embedding lookups, norms, activations and the optimizer update are not counted (they are a few percent).
Attention is counted for the causal half only, as MaxText does since AI-Hypercomputer/maxtext PR#1988, so MFU
measures the FLOPs the model needs rather than what a dense masked kernel executes (``attention="full"``
gives 12 * L * T * H*h, what XLA's cost analysis counts). MFU = FLOPs per token x tokens/s / (devices x dense
peak FLOP/s of one device), with the peak looked up from the device kind; unknown devices get FLOP/s without
MFU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from functrain.models.configs.base import DecoderShape
from functrain.parallel.chips import TERA, chip_of

log = logging.getLogger("functrain")


def peak_tflops(device_kind: str) -> float | None:
    """Dense bf16 peak TFLOP/s of one device of this kind, or None when unknown (CPUs among them)."""
    chip = chip_of(device_kind)
    return chip.peak_flops / TERA if chip else None


def train_flops_per_token(shape: DecoderShape, context: int, attention: str = "causal") -> float:
    """Training FLOPs per token (formula in the module docstring); ``attention``: "causal" or "full"."""
    s = shape
    attention_width = s.heads * s.head_dim
    projections = (
        s.width * attention_width + 2 * s.width * s.kv_heads * s.head_dim + attention_width * s.width
        if s.attention_params is None
        else s.attention_params
    )
    per_layer = projections + s.mlp_matrices * s.width * s.mlp_width + s.width * s.router_width
    matmuls = 6.0 * (s.layers * per_layer + s.width * s.vocab) + 3.0 * s.mixer_flops
    value_width = s.heads * (s.head_dim if s.value_head_dim is None else s.value_head_dim)
    attending = s.layers if s.attention_layers is None else s.attention_layers
    full_attention = 6.0 * attending * context * (attention_width + value_width)
    return matmuls + (full_attention / 2 if attention == "causal" else full_attention)


@dataclass(frozen=True)
class SpeedReport:
    """Turns steps/s into the throughput fields of a train log line."""

    samples_per_step: int
    tokens_per_step: int | None
    flops_per_token: float | None
    devices: int
    peak_flops_per_device: float | None

    def fields(self, steps_per_sec: float) -> dict[str, float]:
        values = {"samples_per_sec": steps_per_sec * self.samples_per_step}
        if self.tokens_per_step:
            tokens_per_sec = steps_per_sec * self.tokens_per_step
            values.update(tokens_per_sec=tokens_per_sec, tokens_per_sec_per_device=tokens_per_sec / self.devices)
            if self.flops_per_token:
                flops_per_device = self.flops_per_token * tokens_per_sec / self.devices
                values["model_tflops_per_sec_per_device"] = flops_per_device / 1e12
                if self.peak_flops_per_device:
                    values["mfu"] = flops_per_device / self.peak_flops_per_device
        return values


def speed_report(
    shape: DecoderShape | None, tokens_per_sample: int | None, global_batch_size: int, devices: list[Any]
) -> SpeedReport:
    """The report for a run: token counts when a sample is ``tokens_per_sample`` tokens (None: not a token
    window), FLOPs when the model's decoder ``shape`` is known (a model config's ``decoder_shape()``), the peak of
    its devices when their kind is known (an accelerator of unknown kind gets a warning naming it)."""
    tokens = global_batch_size * tokens_per_sample if tokens_per_sample else None
    flops = train_flops_per_token(shape, tokens_per_sample) if tokens_per_sample and tokens and shape else None
    device_kind = devices[0].device_kind if devices else "unknown"
    peak = peak_tflops(device_kind)
    if flops and peak is None and devices and devices[0].platform != "cpu":
        log.warning(
            "functrain: warning: no known peak FLOP/s for device kind %r: MFU is not reported (add it to "
            "functrain.parallel.chips.CHIPS)",
            device_kind,
        )
    return SpeedReport(
        samples_per_step=global_batch_size,
        tokens_per_step=tokens,
        flops_per_token=flops,
        devices=max(len(devices), 1),
        peak_flops_per_device=peak * 1e12 if peak else None,
    )
