"""Sampling from the model being trained, for the tasks whose experience stage needs its own completions (GRPO's
rollouts, on-policy distillation), and the per-token log-probs both the sampler and the losses read.

:class:`Sampler` compiles, once per run, the KV-cache decoder of ``functrain generate``
(:func:`functrain.text.decode.generate_ragged`: prompts of any length in one batch, without a padding mask) on the
step's own weights (cast to ``train.compute_dtype``, LoRA adapters merged, scanned layers unrolled: no second copy
to keep in sync), and the training forward (the program's pieces) that scores tokens as the loss does.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from functrain.core.adapters import ModelPieces
from functrain.core.precision import COMPUTE_DTYPES, at_precision, cast_floating, matmul_precision
from functrain.core.unembedding import chunk_positions, logits_array, over_chunks
from functrain.data.global_array import batch_sharding, to_global, to_local
from functrain.errors import ConfigError
from functrain.models import build_model
from functrain.models.lora import merged_for_inference
from functrain.models.options import for_sampling
from functrain.models.stacking import unstack_layers
from functrain.parallel.determinism import attention_choice, step_compiler_options
from functrain.parallel.target import target_platform
from functrain.text.decode import generate_ragged
from functrain.text.paged_decode import Paging, generate_paged, unpageable_leaves

# The XLA:CPU options under which the sampler's decoder and the train step compute a token's log-prob bit for bit
# alike (GRPO's rollout/logprob_gap is 0): YNNPACK runs the products only (its fused element-wise and reduction
# kernels round unlike XLA's own, and which ones it fuses depends on the program), and in its consistent-arithmetic
# mode (XLA's platform-independent math), where a product's rounding does not depend on its shape; by default a
# decoded token's few rows and a training batch's many went to kernels that differed in the last bits (up to 3e-5
# on the bundled example's log-probs). The rest is the models' (a decoded query gets a second row:
# functrain.models.attention) and the train step's (GRPO's policy forward, rematerialised with a reference).
CONSISTENT_OPTIONS: dict[str, str | bool] = {
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
    "xla_cpu_enable_platform_dependent_math": False,
}
# A batch-invariant model's (model.batch_invariant, functrain.models.batch_invariant): YNNPACK runs each product
# alone. Fused into a product of many rows, an activation (GPT's tanh GELU) or a softmax's exp was YNNPACK's to
# compute, and XLA's for a decoded token's few rows, which rounded otherwise.
INVARIANT_OPTIONS: dict[str, str | bool] = {
    **CONSISTENT_OPTIONS,
    "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
# XLA:CPU splits a decoded token's small kernels over its threads for less than the split costs: on one thread the
# sampler takes about half the CPU time (bench_grpo: 14 -> 7.5 ms a rollout).
ONE_THREAD: dict[str, str | bool] = {"xla_cpu_multi_thread_eigen": False}
DECODER_OPTIONS: dict[str, str | bool] = {**CONSISTENT_OPTIONS, **ONE_THREAD}


def consistent_options(model_config: Any) -> dict[str, str | bool]:
    """The XLA:CPU options under which a train step computes its model's log-probs as the sampler does:
    :data:`INVARIANT_OPTIONS` for a batch-invariant model, else :data:`CONSISTENT_OPTIONS`."""
    return INVARIANT_OPTIONS if getattr(model_config, "batch_invariant", False) else CONSISTENT_OPTIONS


def on_cpu(options: dict[str, Any]) -> dict[str, Any] | None:
    """XLA:CPU ``options`` when the run is compiled for CPUs, else None (other compilers may not know them)."""
    return options if target_platform() == "cpu" else None


def token_logps(logits: Any, tokens: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """``(log-probs, entropies)`` ``[B, L-1]`` at ``temperature``: ``logits`` ``[B, L-1, V]`` of ``tokens[:, :-1]``
    (or the model's :class:`~functrain.core.unembedding.Unembedding`, whose logits are then formed chunk by chunk
    where they would be large, ``train.logits_chunk``); position ``t`` scores token ``t + 1`` and holds the entropy
    of the distribution it was drawn from."""

    def scored(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
        picked = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
        return picked, -(jnp.exp(log_probs) * log_probs).sum(-1)

    chunk = chunk_positions(logits)
    if chunk is None:
        return scored(logits_array(logits), tokens[:, 1:])
    picked, entropies = over_chunks(logits, tokens[:, 1:], chunk, scored)
    return picked, entropies


class Sampler:
    """A run's compiled sampler (``sample``) and training forward (``forward``), on the params' mesh: each process
    gives its rows and gets its rows back, and the devices split them as the train step splits its batch.

    ``sample(params, prompts, lengths, key, prefill=N, repeats=R) -> (tokens, logps)``: ``max_new_tokens`` new tokens
    after each right-padded prompt (see :func:`~functrain.text.decode.generate_ragged`; rows in runs of ``R`` copies
    of a prompt share its prefill), drawn at ``temperature`` from the
    ``top_k`` most likely (None: all) within ``top_p`` of the probability (None: all), with their log-probs at
    ``temperature``. ``forward(params, tokens) -> logps`` ``[B, L-1]``: the training forward's log-probs of
    ``tokens[:, 1:]`` at ``temperature``. Both trace their products at ``precision`` (``train.matmul_precision``) and
    compile with a GPU's deterministic ops when ``deterministic`` (``train.deterministic``), with XLA's attention
    then, as the train step. With ``paging`` the sampler decodes paged (:mod:`functrain.text.paged_decode`: the
    same tokens, rows that drew a stop id stop costing; after it, token 0)."""

    def __init__(
        self,
        model_config: Any,
        pieces: ModelPieces,
        compute_dtype: str,
        *,
        max_new_tokens: int,
        temperature: float,
        top_k: int | None = None,
        top_p: float | None = None,
        precision: str = "auto",
        deterministic: bool = True,
        paging: Paging | None = None,
    ) -> None:
        dtype = COMPUTE_DTYPES[compute_dtype]
        # The step's attention on a deterministic GPU run (XLA's: cuDNN's does not compile with deterministic ops).
        self.attention = attention_choice("auto", target_platform(), deterministic)
        sampling_model = build_model(for_sampling(model_config).model_copy(update={"attention": self.attention}), dtype)
        decode = (
            generate_ragged if paging is None else paged_decoder(sampling_model, paging, model_config.registry_name())
        )

        def sample(params, prompts, lengths, key, prefill, repeats=1):
            weights = unstack_layers(merged_for_inference(cast_floating(params, dtype), model_config))
            return decode(
                sampling_model,
                weights,
                prompts,
                lengths,
                key,
                prefill=prefill,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                repeats=repeats,
            )

        def forward(params, tokens):
            output = pieces.apply(cast_floating(params, dtype), {}, tokens[:, :-1], False, jax.random.PRNGKey(0))
            return token_logps(output.logits, tokens, temperature)[0]

        # The step's products' precision (train.matmul_precision), so that both round float32 operands alike.
        products = matmul_precision(precision, compute_dtype, target_platform())
        self._functions = (at_precision(sample, products), at_precision(forward, products))
        # A GPU's deterministic ops too (train.deterministic), as the step's: a resumed run recompiles the sampler, and
        # its draws must be the uninterrupted run's.
        decoder_options = {**consistent_options(model_config), **ONE_THREAD}
        self.compiler_options = step_compiler_options(target_platform(), deterministic, on_cpu(decoder_options))
        self._programs: dict[Mesh, tuple[Any, Any]] = {}

    def programs(self, mesh: Mesh) -> tuple[Any, Any]:
        """The compiled sampler and forward on ``mesh`` (the params'): their rows split over its data-parallel devices
        as the train step's batch."""
        if mesh not in self._programs:
            rows = batch_sharding(mesh, batch_axis=0)
            sample, forward = self._functions
            options = self.compiler_options
            self._programs[mesh] = (
                jax.jit(sample, static_argnames=("prefill", "repeats"), out_shardings=rows, compiler_options=options),
                jax.jit(forward, out_shardings=rows, compiler_options=options),
            )
        return self._programs[mesh]

    def sample(
        self, params: Any, prompts: np.ndarray, lengths: np.ndarray, key: jax.Array, *, prefill: int, repeats: int = 1
    ) -> tuple[np.ndarray, np.ndarray]:
        """This process's rows of the batch (``prompts``, ``lengths``) -> their tokens and log-probs, as host arrays;
        every process of the run calls it with its own rows (the data loader's)."""
        mesh = _mesh_of(params)
        prompts, lengths = _global_rows(mesh, prompts, lengths)
        tokens, logps = self.programs(mesh)[0](params, prompts, lengths, key, prefill=prefill, repeats=repeats)
        return to_local(tokens), to_local(logps)

    def forward(self, params: Any, tokens: np.ndarray) -> jax.Array:
        """The training forward's log-probs of this process's rows ``tokens``, dispatched: a global array whose rows
        :func:`functrain.data.global_array.to_local` gives."""
        mesh = _mesh_of(params)
        return self.programs(mesh)[1](params, *_global_rows(mesh, tokens))


def paged_decoder(model: Any, paging: Paging, name: str | None) -> Any:
    """:func:`~functrain.text.paged_decode.generate_paged` with ``paging``'s settings, for a ``model`` (``model.name``
    ``name``) whose decoding cache has a paged form (else a ConfigError)."""
    unpageable = unpageable_leaves(model)
    if unpageable:
        raise ConfigError(
            f"grpo.sampler=paged needs a model whose decoding cache holds keys and values only, and "
            f"model.name={name} caches {', '.join(unpageable)}; set grpo.sampler=dense"
        )
    return partial(generate_paged, page_size=paging.page_size, slots=paging.slots, stop_ids=paging.stop_ids)


def _mesh_of(params: Any) -> Mesh:
    """The mesh the params lie on (a run's train state's)."""
    sharding = jax.tree.leaves(params)[0].sharding
    assert isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh), "a run's params, on its mesh"
    return sharding.mesh


def _global_rows(mesh: Mesh, *local: np.ndarray) -> tuple[Any, ...]:
    """This process's rows as global arrays split over ``mesh``'s data-parallel devices."""
    return tuple(to_global(list(local), batch_sharding(mesh, batch_axis=0), batch_axis=0))
