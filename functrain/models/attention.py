"""Fused attention for the built-in models (GPT, GPT-2, Llama and its family, Gemma 2).

``model.attention`` picks the kernel:

- ``xla``: any platform, ``jax.nn.dot_product_attention``: scores and softmax in float32, the output in the
  compute dtype; it materialises each layer's ``[T, T]`` scores per head;
- ``cudnn``: cuDNN flash attention (NVIDIA GPU of compute capability 8.0+, bfloat16/float16 compute, a head
  width that is a multiple of 8 up to 256);
- ``splash``: the Pallas splash (flash) attention kernel for TPU (:mod:`functrain.models.splash`: bfloat16 or
  float32 compute, a head width up to 256, any sequence length);
- ``auto``: ``cudnn`` on a GPU and ``splash`` on a TPU where they take the compute dtype and head width, else
  ``xla``.

Asking for ``cudnn`` or ``splash`` where it cannot run is a one-line ConfigError. The platform is the one the
run is compiled for (:mod:`functrain.parallel.target`): ``functrain plan --topology`` picks ``splash`` from a
CPU process. :func:`pallas_interpreted` makes ``splash`` available anywhere, run by the Pallas interpreter
(the tests compare it with ``xla`` on CPU).

Masks: always causal; with ``segment_ids`` [B, T] (packed sequences) a token also attends only to tokens of
its own segment; with ``window`` only to the keys of its last ``window`` positions (sliding-window attention,
Mistral, Qwen2, Phi-3, Gemma); with ``chunk`` only to the keys of its own chunk of positions (Llama 4: a whole
sequence's chunks become segments, which every kernel masks). Soft-capped scores (Gemma 2) and attention sinks
(GPT-OSS: one learned logit per query head that joins every softmax and takes its share of the probability,
attending to nothing) run in ``splash``, which caps and sinks inside the kernel; the other kernels have no fused
form and run the same maths written out (scores and softmax in float32).
Grouped-query heads (fewer key/value heads than query heads) are grouped under their shared key/value head by
every kernel; keys and values are never repeated in memory. When decoding with a KV cache
(:mod:`functrain.models.kv_cache`) the queries sit at given slots of a longer cache, so the mask is written
out and the XLA kernel runs (one new token gains nothing from a flash kernel). Under a ``context`` mesh axis larger
than 1 a whole sequence arrives in load-balanced order, split over that axis, and attends through
:mod:`functrain.models.context_attention`.
"""

from typing import Any, Literal

import jax
import jax.numpy as jnp

from functrain.errors import ConfigError
from functrain.models.batch_invariant import batch_invariant, invariant_attention
from functrain.models.context_attention import context_attention
from functrain.models.kv_cache import causal_mask
from functrain.models.masked_attention import chunk_segments, masked_attention, segment_mask
from functrain.models.options import AttentionChoice
from functrain.models.splash import interpreted as pallas_interpreted
from functrain.models.splash import is_interpreted, splash_attention, splash_problem
from functrain.parallel.context import context_ways
from functrain.parallel.target import target_name, target_platform

Array = jax.Array
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)

__all__ = [
    "AttentionChoice",
    "attend",
    "attention_kernel",
    "cudnn_available",
    "pallas_interpreted",
    "segment_mask",
    "splash_available",
]


def cudnn_available() -> bool:
    """True when the run is compiled for NVIDIA GPUs that run cuDNN flash attention (Ampere or newer)."""
    if target_platform() not in ("gpu", "cuda"):
        return False
    device = jax.devices()[0]  # a GPU run is compiled where it runs: the device has its compute capability
    capability = getattr(device, "compute_capability", None)
    return device.platform in ("gpu", "cuda") and capability is not None and float(capability) >= 8.0


def splash_available() -> bool:
    """True when the run is compiled for TPUs, or inside :func:`pallas_interpreted`."""
    return target_platform() == "tpu" or is_interpreted()


def _cudnn_fits(dtype: Any, head_dim: int) -> bool:
    return any(jnp.dtype(dtype) == jnp.dtype(d) for d in CUDNN_DTYPES) and head_dim % 8 == 0 and head_dim <= 256


def attention_kernel(choice: AttentionChoice, dtype: Any, head_dim: int) -> Literal["xla", "cudnn", "splash"]:
    """The kernel ``model.attention=choice`` runs for ``dtype`` compute and ``head_dim``-wide heads.

    Raises ConfigError (one line) when ``cudnn`` or ``splash`` is asked for where it cannot run.
    """
    if choice == "xla":
        return "xla"
    if choice == "auto":
        if cudnn_available() and _cudnn_fits(dtype, head_dim):
            return "cudnn"
        return "splash" if splash_available() and splash_problem(dtype, head_dim) is None else "xla"
    if choice == "splash":
        return _checked_splash(dtype, head_dim)
    if not cudnn_available():
        raise ConfigError(
            f"model.attention=cudnn needs an NVIDIA GPU (compute capability 8.0+) and this run's "
            f"devices are {target_name()}; set model.attention=auto or model.attention=xla"
        )
    if not _cudnn_fits(dtype, head_dim):
        raise ConfigError(
            f"model.attention=cudnn needs train.compute_dtype bfloat16 or float16 and a head width "
            f"that is a multiple of 8 up to 256 (got {jnp.dtype(dtype).name}, {head_dim}); change "
            f"those or set model.attention=auto"
        )
    return "cudnn"


def _checked_splash(dtype: Any, head_dim: int) -> Literal["splash"]:
    if not splash_available():
        raise ConfigError(
            f"model.attention=splash needs a TPU and this run's devices are {target_name()}; "
            f"set model.attention=auto or model.attention=xla"
        )
    problem = splash_problem(dtype, head_dim)
    if problem is not None:
        raise ConfigError(f"model.attention=splash needs {problem}; set model.attention=xla (or auto)")
    return "splash"


def attend(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    kernel: Literal["xla", "cudnn", "splash"],
    segment_ids: Array | None = None,
    query_slots: Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
    chunk: int | None = None,
) -> Array:
    """Causal softmax attention.

    Args:
      query: ``[B, T, H, D]``; key, value: ``[B, S, KV, D]`` with H a multiple of KV, all of one dtype.
      scale: multiplies the scores.
      kernel: ``xla``, ``cudnn`` or ``splash`` (see :func:`attention_kernel`).
      segment_ids: optional ``[B, T]`` int: tokens attend only within their segment (whole sequences only).
      query_slots: when decoding with a cache, the queries' ``[T]`` slots among the S cached keys (keys at
        later slots are masked), ``[B, T]`` against a paged cache (each row its own); None for a whole sequence
        (S == T).
      window: attend only to the keys of the last ``window`` positions (None: all earlier keys).
      softcap: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2).
      sinks: optional ``[H]`` logits, one per query head, each an extra column of that head's softmax whose
        probability is dropped (GPT-OSS's attention sinks): the weights of the real keys sum to less than one.
      chunk: attend only to the keys of the query's own chunk of ``chunk`` positions (Llama 4's chunked attention:
        a whole sequence's chunks counted from each segment's start, a cache's from its first slot).

    Returns ``[B, T, H, D]`` in the query's dtype.
    """
    if query_slots is not None and segment_ids is not None:
        raise ValueError("segment_ids are for whole sequences, not for decoding with a KV cache")
    if chunk is not None and query_slots is None:
        segment_ids = _chunks_as_segments(segment_ids, query, chunk)
    if batch_invariant():  # one kernel for whole sequences and decoding, whatever the batch
        return _attend_with_written_mask(
            query, key, value, scale, segment_ids, query_slots, window, softcap, sinks, chunk, invariant=True
        )
    if query_slots is None and context_ways() > 1:
        return context_attention(
            query,
            key,
            value,
            scale=scale,
            kernel=kernel,
            segment_ids=segment_ids,
            window=window,
            softcap=softcap,
            sinks=sinks,
        )
    if kernel == "splash" and query_slots is None:
        return splash_attention(
            query, key, value, scale=scale, segment_ids=segment_ids, window=window, softcap=softcap, sinks=sinks
        )
    if softcap is not None or sinks is not None or query_slots is not None:
        return _attend_with_written_mask(
            query, key, value, scale, segment_ids, query_slots, window, softcap, sinks, chunk
        )
    mask = None if segment_ids is None else segment_mask(segment_ids)
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        scale=scale,
        is_causal=True,  # not splash here
        local_window_size=local,
        implementation="cudnn" if kernel == "cudnn" else "xla",
    )


def _chunks_as_segments(segment_ids: Array | None, query: Array, chunk: int) -> Array:
    """A whole sequence's ``segment_ids`` with each segment cut into chunks of ``chunk`` positions, counted from the
    segment's start: segments of their own, which every kernel masks (Llama 4's chunked attention)."""
    if context_ways() > 1:  # the families with chunks declare no context parallelism: this is not reached
        raise ValueError("chunked attention does not split the sequence over mesh.context")
    return chunk_segments(segment_ids, query.shape[0], query.shape[1], chunk)


def _attend_with_written_mask(
    query: Array,
    key: Array,
    value: Array,
    scale: float,
    segment_ids: Array | None,
    query_slots: Array | None,
    window: int | None,
    softcap: float | None,
    sinks: Array | None,
    chunk: int | None,
    invariant: bool = False,
) -> Array:
    """:func:`attend` with its mask written out (soft caps, sinks, decoding against a cache, or ``invariant``:
    :func:`~functrain.models.batch_invariant.invariant_attention`)."""
    slots = jnp.arange(query.shape[1], dtype=jnp.int32) if query_slots is None else query_slots
    # XLA:CPU takes a product of one query row to another kernel than a whole sequence's rows, which rounds
    # differently: a decoded token's query gets a second row of zeros, so that decoding and training agree bit
    # for bit under functrain.tasks.sampling.CONSISTENT_OPTIONS (GRPO's rollout/logprob_gap; a copy of the query
    # instead of zeros let LLVM share the two rows' work and round it otherwise). With grouped-query heads a
    # group's query heads are the rows of its products already (and the second row cost bench_grpo.py's
    # rollout 1 of 8 ms).
    single = (
        not invariant
        and query_slots is not None
        and query.shape[1] == 1
        and query.shape[2] == key.shape[2]
        and target_platform() == "cpu"
    )
    if single:
        query, slots = jnp.concatenate([query, jnp.zeros_like(query)], axis=1), jnp.concatenate([slots, slots], -1)
    decoded_chunk = None if query_slots is None else chunk  # a whole sequence's chunks are its segments already
    written = causal_mask(slots, key.shape[1], window, decoded_chunk)
    written = written[:, None] if slots.ndim == 2 else written[None, None]  # [B or 1, 1, T, S]
    if segment_ids is not None:
        written = written & segment_mask(segment_ids)
    attention = invariant_attention if invariant else masked_attention
    attended = attention(query, key, value, scale=scale, mask=written, softcap=softcap, sinks=sinks)
    return attended[:, :1] if single else attended
