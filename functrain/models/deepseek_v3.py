"""DeepSeek-V3 as a Flax module with the maths of HF's ``DeepseekV3ForCausalLM``.

Each layer is pre-RMSNorm: multi-head latent attention (:mod:`functrain.models.mla`), then a SwiGLU MLP of
``intermediate_size`` on the first ``first_k_dense_replace`` layers and, on the others, a mixture of experts
(:class:`functrain.models.moe.layer.MoeBlock` with DeepSeek's routing, :mod:`functrain.models.deepseek_routing`)
plus ``n_shared_experts`` experts' worth of always-on MLP (``shared_experts``). The output is a
:class:`functrain.core.model_output.ModelOutput`: the logits and every layer's router statistics.

Parameters: the dense layers are ``dense_layers_{i}`` and the MoE layers ``moe_layers_{j}`` (HF's layer
``first_k_dense_replace + j``): two runs of identical layers, so ``model.scan_layers`` scans each as one stack
(``dense_layers_stack``, ``moe_layers_stack``), as MaxText does; pipeline stages (``mesh.pipeline``) split the
MoE stack, and every stage runs the dense layers whole. An MoE layer's ``e_score_correction_bias`` is a
leaf of the params (so conversion, sampling and export carry it) that no gradient and no optimizer moves: the
module marks it frozen (:meth:`DeepseekV3ForCausalLM.trainable_mask`) and, with ``bias_update_rate``, counts each
expert's selections over a training step in the ``router_counts`` model state, from which the step's end
(:meth:`DeepseekV3ForCausalLM.end_of_step`) moves the bias.

With ``num_nextn_predict_layers`` the model ends in DeepSeek's multi-token-prediction modules
(:mod:`functrain.models.mtp`, ``mtp_layers_{d}``: one decoder layer each, sharing the embedding and head), whose
terms (``model.mtp_loss_weight``) join the MoE's; decoding never runs them.

GLM-4.5 (:mod:`functrain.models.glm4_moe`) is this decoder with Llama's grouped-query attention in place of the
latent attention (the module's ``attention``), as transformers derives ``Glm4MoeForCausalLM`` from DeepSeek-V3's.
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict

from functrain.core.model_output import CombinedTerms, ModelOutput
from functrain.errors import ConfigError
from functrain.models import llama
from functrain.models.attention import attention_kernel
from functrain.models.configs.deepseek_moe import DEEPSEEK_RUNTIME_KEYS
from functrain.models.configs.deepseek_v3 import DeepseekV3Config
from functrain.models.configs.glm4_moe import Glm4MoeConfig
from functrain.models.configs.moe import MOE_RUNTIME_KEYS
from functrain.models.deepseek_routing import sigmoid_group_limited, updated_bias
from functrain.models.hf_common import RMSNorm, embed, hf_config_dict, lm_head_of
from functrain.models.kv_cache import decoding
from functrain.models.mla import LatentAttention
from functrain.models.moe.balance import moe_output
from functrain.models.moe.decoder import balancing, gated, moe_context_inputs
from functrain.models.moe.layer import MoeBlock, RouterStats
from functrain.models.mtp import MTP_PREFIX, multi_token_prediction
from functrain.models.remat import check_remat, remat_block
from functrain.models.rope import hf_rope_parameters, parse_hf_rope
from functrain.models.scan import apply_layers
from functrain.parallel.context import from_context_order, to_context_order
from functrain.parallel.pipeline import stage_count
from functrain.parallel.sharding import constrain_batch

DENSE_PREFIX, MOE_PREFIX = "dense_layers_", "moe_layers_"
CORRECTION_BIAS = "e_score_correction_bias"
# The model state of the bias update: each MoE layer's selections of each expert so far in the training step.
COUNTS_COLLECTION, COUNTS = "router_counts", "selection_counts"
# The configs of the families whose decoder this is: DeepSeek-V3's (latent attention) and GLM-4.5's (Llama's).
DeepseekMoeConfig = DeepseekV3Config | Glm4MoeConfig
# Keys of the original DeepSeek config.json (trust_remote_code) naming what V3 is; anything else is another model.
_DEEPSEEK_V3_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def from_hf_config(hf: dict[str, Any]) -> DeepseekV3Config:
    """DeepseekV3Config from an HF config.json dict (transformers' or the original release's keys)."""
    for key, value in _DEEPSEEK_V3_ROUTING.items():
        if key in hf and hf[key] != value:
            raise ConfigError(
                f"config.json: {key} {hf[key]!r} is not DeepSeek-V3's ({value!r}); only DeepSeek-V3's routing is "
                f"supported; fix config.json"
            )
    try:
        hf, scaling = parse_hf_rope(hf)
    except ValueError as err:
        raise ConfigError(f"config.json: {err} for deepseek_v3; fix config.json") from None
    overrides: dict[str, Any] = {"rope_scaling": scaling} if scaling else {}
    if "q_lora_rank" in hf:  # null means queries without the low-rank bottleneck, not the default rank
        overrides["q_lora_rank"] = hf["q_lora_rank"]
    return DeepseekV3Config.from_hf_dict(hf, **overrides)


def to_hf_config(config: DeepseekV3Config) -> dict[str, Any]:
    """An HF config.json dict (transformers 5 layout) that loads as DeepseekV3ForCausalLM."""
    hf = hf_config_dict(config, exclude={"rope_theta", "rope_scaling", *DEEPSEEK_RUNTIME_KEYS, *MOE_RUNTIME_KEYS})
    hf.update(
        model_type="deepseek_v3",
        architectures=["DeepseekV3ForCausalLM"],
        num_key_value_heads=config.num_attention_heads,
        rope_parameters=hf_rope_parameters(config),
        attention_dropout=0.0,
        pretraining_tp=1,
    )
    return hf


@dataclass(frozen=True)
class MLPShape:
    """What :class:`functrain.models.llama.LlamaMLP` reads, for DeepSeek's dense and shared-expert MLPs."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str
    initializer_range: float
    mlp_bias: bool = False


def dense_mlp_shape(config: DeepseekMoeConfig) -> MLPShape:
    """The dense layers' MLP (``intermediate_size`` wide)."""
    return MLPShape(config.hidden_size, config.intermediate_size, config.hidden_act, config.initializer_range)


def shared_mlp_shape(config: DeepseekMoeConfig) -> MLPShape:
    """The shared experts as one MLP ``n_shared_experts * moe_intermediate_size`` wide (as HF builds them)."""
    width = config.n_shared_experts * config.moe_intermediate_size
    return MLPShape(config.hidden_size, width, config.hidden_act, config.initializer_range)


class DeepseekV3Block(nn.Module):
    """One pre-RMSNorm decoder layer: the attention (latent attention, or ``attention``), then the dense MLP or the
    mixture of experts; returns ``(x, RouterStats)`` (zeros on a dense layer)."""

    config: DeepseekMoeConfig
    dtype: Any
    moe: bool = False
    attention: Callable[..., nn.Module] = LatentAttention  # (config, dtype, name=...) -> the attention module

    @nn.compact
    def __call__(self, x, segment_ids=None, positions=None, token_mask=None):
        cfg = self.config
        eps = cfg.rms_norm_eps
        x = x + self.attention(cfg, self.dtype, name="self_attn")(
            RMSNorm(eps, self.dtype, name="input_layernorm")(x), segment_ids, positions
        )
        hidden = RMSNorm(eps, self.dtype, name="post_attention_layernorm")(x)
        if not self.moe:
            return x + llama.LlamaMLP(dense_mlp_shape(cfg), self.dtype, name="mlp")(hidden), RouterStats.zeros(
                cfg.n_routed_experts
            )
        y, stats = self._experts(hidden, token_mask)
        if cfg.n_shared_experts:
            y = y + llama.LlamaMLP(shared_mlp_shape(cfg), self.dtype, name="shared_experts")(hidden)
        return x + y, stats

    def _correction_bias(self) -> jax.Array:
        initializer = nn.with_logical_partitioning(nn.initializers.zeros, (None,))
        return jnp.asarray(self.param(CORRECTION_BIAS, initializer, (self.config.n_routed_experts,), jnp.float32))

    def _experts(self, hidden, token_mask):
        cfg = self.config
        router = functools.partial(
            sigmoid_group_limited,
            correction_bias=jax.lax.stop_gradient(self._correction_bias()),  # selection only: no gradient
            top_k=cfg.num_experts_per_tok,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            normalize=cfg.norm_topk_prob,
            scaling=cfg.routed_scaling_factor,
        )
        y, stats = MoeBlock(
            num_experts=cfg.n_routed_experts,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            router=router,
            glu=gated(cfg.hidden_act),
            dispatch=cfg.moe_dispatch,
            capacity_factor=cfg.capacity_factor,
            init_std=cfg.initializer_range,
            dtype=self.dtype,
            name="mlp",
        )(hidden, token_mask)
        if cfg.bias_update_rate and self.is_mutable_collection(COUNTS_COLLECTION):  # a training forward
            counts = self.variable(COUNTS_COLLECTION, COUNTS, jnp.zeros, (cfg.n_routed_experts,), jnp.float32)
            counts.value = counts.value + stats.counts
        return y, stats


class DeepseekV3ForCausalLM(nn.Module):
    """DeepSeek-V3 language model: ``apply({"params": p}, input_ids[B, T]) -> ModelOutput`` (float32 ``.logits``
    [B, T, vocab]); with another ``attention``, GLM-4.5's."""

    config: DeepseekMoeConfig
    dtype: Any = jnp.float32
    attention: Callable[..., nn.Module] = LatentAttention

    @nn.compact
    def __call__(
        self,
        input_ids,
        deterministic: bool = True,
        *,
        segment_ids=None,
        positions=None,
        token_mask=None,
        logits_chunk=None,
    ):
        """Logits and router statistics for ``input_ids``; ``deterministic`` is accepted for the task interface
        (no dropout here); ``segment_ids`` / ``positions`` [B, T]: packed documents (as
        :mod:`functrain.models.llama`); ``token_mask`` [B, T]: the real tokens the statistics count;
        ``logits_chunk``: the head unapplied (:mod:`functrain.models.head`)."""
        cfg = self.config
        std = cfg.initializer_range
        batch_inputs = (input_ids, segment_ids, positions, token_mask)  # in the batch's order, for the MTP's shifts
        # Under a context mesh axis the layers run on the sequence in load-balanced order (parallel/context.py).
        input_ids, segment_ids, positions, token_mask, ways = moe_context_inputs(
            self, input_ids, segment_ids, positions, token_mask
        )
        tokens = embed(cfg.vocab_size, cfg.hidden_size, ("vocab", "embed"), dtype=self.dtype, init_std=std,
                       name="embed_tokens")  # fmt: skip
        x = constrain_batch(tokens(input_ids))
        block = remat_block(DeepseekV3Block, cfg.remat, prevent_cse=not cfg.scan_layers)
        runs = ((False, cfg.dense_layers, DENSE_PREFIX), (True, cfg.num_hidden_layers - cfg.dense_layers, MOE_PREFIX))
        stats = []
        for moe, count, prefix in (run for run in runs if run[1]):

            def make_block(i: int, name: str, moe: bool = moe) -> nn.Module:
                return block(cfg, self.dtype, moe, self.attention, name=name)

            # Only the MoE layers split over pipeline stages: every stage runs the few dense ones whole.
            x, run_stats = apply_layers(
                x, kinds=[moe] * count, make_block=make_block, prefix=prefix, scan=cfg.scan_layers,
                args=(segment_ids, positions, token_mask), collect=True, pipelined=moe,
            )  # fmt: skip
            stats.append(run_stats)
        x = RMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(x)
        head = lm_head_of(self, tokens, cfg, std)
        # The logits in the batch's order, for the loss and every task.
        logits = head(from_context_order(x, ways), logits_chunk)
        settings = balancing(cfg)
        mtp_terms = None
        if cfg.num_nextn_predict_layers and (self.is_initializing() or (cfg.mtp_trained and not decoding(self))):
            mtp_terms, mtp_stats = self._multi_token_prediction(x, tokens, head, batch_inputs, ways)
            stats += [jax.tree.map(lambda *depths: jnp.stack(depths), *mtp_stats)]
            mtp_moe = tuple(layer for layer in cfg.mtp_layers() if cfg.moe_layer(layer))
            settings = dataclasses.replace(settings, moe_layers=settings.moe_layers + mtp_moe)
        layers = jax.tree.map(lambda *runs: jnp.concatenate(runs), *stats)  # [L (+ D), ...] in layer order
        output = moe_output(logits, layers, settings)
        return output if mtp_terms is None else ModelOutput(logits, CombinedTerms((output.terms, mtp_terms)))

    def _multi_token_prediction(self, x, tokens, head, batch_inputs, ways):
        """The multi-token-prediction modules on the final hidden states ``x`` (in the layers' order)."""
        cfg = self.config
        if stage_count() > 1 or ways > 1:  # not tested on those meshes yet
            raise ConfigError(
                "model.num_nextn_predict_layers (multi-token prediction) does not run under mesh.pipeline > 1 or "
                "mesh.context > 1; set model.mtp_loss_weight=0 to train without it, or those axes to 1"
            )
        block = remat_block(DeepseekV3Block, cfg.remat, prevent_cse=True)

        def make_block(depth: int, name: str) -> nn.Module:
            return block(cfg, self.dtype, cfg.moe_layer(cfg.mtp_layers()[depth]), self.attention, name=name)

        return multi_token_prediction(
            x, embed=tokens, head=head, make_block=make_block, inputs=batch_inputs,
            reorder=functools.partial(to_context_order, ways=ways), config=cfg, dtype=self.dtype,
        )  # fmt: skip

    @nn.nowrap
    def trainable_mask(self, params: Any) -> Any:
        """False at the correction biases (moved by :meth:`end_of_step`, never by the optimizer) and, when
        ``mtp_loss_weight`` is 0, at the multi-token-prediction layers (kept as converted: no loss reaches them, and
        weight decay must not shrink them); True elsewhere."""
        frozen_mtp = not self.config.mtp_trained
        return unflatten_dict(
            {
                path: path[-1] != CORRECTION_BIAS and not (frozen_mtp and path[0].startswith(MTP_PREFIX))
                for path in flatten_dict(params)
            }
        )

    @nn.nowrap
    def end_of_step(self, params: Any, model_state: Any) -> tuple[Any, Any]:
        """After a training step's update: each MoE layer's correction bias moved by ``bias_update_rate`` towards
        its mean load from the step's selection counts (every micro-batch's), and the counts back to zero."""
        if COUNTS_COLLECTION not in model_state:
            return params, model_state
        flat = dict(flatten_dict(params))
        counts = flatten_dict(model_state[COUNTS_COLLECTION])
        for path, count in counts.items():
            bias = path[:-1] + (CORRECTION_BIAS,)
            flat[bias] = updated_bias(flat[bias], count, self.config.bias_update_rate)
        zeroed = unflatten_dict({path: jnp.zeros_like(count) for path, count in counts.items()})
        return unflatten_dict(flat), {**model_state, COUNTS_COLLECTION: zeroed}


def hf_layer_path(config: DeepseekMoeConfig, layer: int) -> tuple[str, ...]:
    """The functrain module of HF's ``model.layers.{layer}`` (unrolled), past ``num_hidden_layers`` the decoder layer
    of a multi-token-prediction module."""
    if layer >= config.num_hidden_layers:
        return f"{MTP_PREFIX}{layer - config.num_hidden_layers}", "block"
    if config.moe_layer(layer):
        return (f"{MOE_PREFIX}{layer - config.dense_layers}",)
    return (f"{DENSE_PREFIX}{layer}",)


def build(config: DeepseekV3Config, dtype: Any = jnp.float32) -> DeepseekV3ForCausalLM:
    """The Flax module for ``config`` computing in ``dtype`` (params stay float32); a ConfigError if its
    attention kernel or remat policy cannot run here."""
    attention_kernel(config.attention, dtype, max(config.qk_head_dim, config.v_head_dim))
    check_remat(config.remat)
    return DeepseekV3ForCausalLM(config, dtype=dtype)
