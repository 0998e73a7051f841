"""Attention with the sequence split over the ``context`` mesh axis (context parallelism).

The queries, keys and values arrive in load-balanced order (:mod:`functrain.parallel.context`), each device
holding ``T / C`` of them. Inside a ``shard_map`` each device **all-gathers** the keys and values (and their
segment ids) over ``context``, puts them back in their original order, and attends with its own queries, masked
by the queries' true positions: causal, the segment ids of packed documents, a sliding window.

All-gather rather than a ring (``ppermute`` of key/value blocks, overlapping each transfer with a block of
compute): the models this serves use grouped-query attention, whose keys and values are a fraction of the
activations (Llama 3 8B: 8 key/value heads against 32 query heads, 512 MiB of keys and values a layer at 128k
tokens in bfloat16), so gathering them takes milliseconds at ICI bandwidth against a layer's compute of a tenth
of a second or more; the gather is one collective
XLA can schedule ahead of the attention, and the splash kernel then runs on whole key sequences with its block
skipping intact. That is MaxText's choice for GQA models; a ring pays off with full multi-head attention or
sequences beyond what one device's gathered keys and values fit.

Kernels: ``xla`` (and ``cudnn``, which takes no written-out mask) run :func:`masked_attention` with the mask as
an array (``[T / C, T]`` a device); ``splash`` runs the Pallas kernel with a mask computed from the queries' true
positions (:func:`functrain.models.splash.ordered_kernel`), each device reading its queries' part of it, so the
fully masked blocks are skipped as in one-device causal attention.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from functrain.models.kv_cache import causal_mask
from functrain.models.masked_attention import masked_attention, segment_mask
from functrain.models.splash import kernel_specs, ordered_kernel, run_kernel, shard_specs
from functrain.parallel.context import CONTEXT_AXIS, context_ways, load_balanced_order

Array = jax.Array


def context_attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: float,
    kernel: str,
    segment_ids: Array | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Array | None = None,
) -> Array:
    """Causal attention of a sequence in load-balanced order, split over the mesh's ``context`` axis; arguments
    and result as :func:`functrain.models.attention.attend` (whole sequences: ``[B, T, H, D]`` queries, ``[B, T,
    KV, D]`` keys and values, ``[B, T]`` segment ids, all in load-balanced order)."""
    ways = context_ways()
    batch, length, heads, _ = query.shape
    order = load_balanced_order(length, ways)
    original = np.argsort(order)
    specs = shard_specs(batch, heads, key.shape[2], sequence_axis=CONTEXT_AXIS)
    assert specs is not None, "context_ways() > 1: a mesh is in context"
    sequence_spec, segment_spec, sinks_spec = specs

    def gathered(x: Array) -> Array:
        """This device's ``[b, T / C, ...]`` -> the whole ``[b, T, ...]``, in the original token order."""
        return jnp.take(jax.lax.all_gather(x, CONTEXT_AXIS, axis=1, tiled=True), original, axis=1)

    def segments(local: Array | None) -> tuple[Array, Array] | None:
        """The queries' segment ids and the keys' (all of them, gathered), or None."""
        return None if local is None else (local, gathered(local))

    if kernel == "splash":
        head_axis = sequence_spec[2]
        head_ways = 1 if head_axis is None else int(jax.sharding.get_abstract_mesh().shape[head_axis])
        splash = ordered_kernel(heads // head_ways, length, ways, window, softcap)
        # The kernel has no scale argument: scaling the queries scales the scores (before any soft-cap).
        query = query * jnp.asarray(scale, query.dtype)

        def local_splash(q: Array, k: Array, v: Array, s: Array | None, h: Array | None, run: object) -> Array:
            return run_kernel(run, q, gathered(k), gathered(v), segments(s), h)

        in_specs = (
            sequence_spec,
            sequence_spec,
            sequence_spec,
            segment_spec,
            sinks_spec,
            kernel_specs(splash, CONTEXT_AXIS),
        )
        return jax.shard_map(local_splash, in_specs=in_specs, out_specs=sequence_spec, check_vma=False)(
            query, key, value, segment_ids, sinks, splash
        )

    def local_xla(q: Array, k: Array, v: Array, s: Array | None, h: Array | None, positions: Array) -> Array:
        mask = causal_mask(positions, length, window)[None, None]
        if (pair := segments(s)) is not None:
            mask = mask & segment_mask(*pair)
        return masked_attention(q, gathered(k), gathered(v), scale=scale, mask=mask, softcap=softcap, sinks=h)

    in_specs = (sequence_spec, sequence_spec, sequence_spec, segment_spec, sinks_spec, PartitionSpec(CONTEXT_AXIS))
    return jax.shard_map(local_xla, in_specs=in_specs, out_specs=sequence_spec, check_vma=False)(
        query, key, value, segment_ids, sinks, jnp.asarray(order)
    )
