"""``model.name: gpt_oss``: OpenAI's GPT-OSS with HF's config.json keys (:mod:`functrain.models.gpt_oss`).

Llama's attention with biases on every projection and one learned sink logit per query head, sliding-window and
full layers alternating as ``layer_types`` says, YaRN RoPE, and a mixture of experts in place of the MLP: a biased
router whose top ``num_experts_per_tok`` logits are softmaxed, experts with biases and a clamped SwiGLU
(``swiglu_alpha``, ``swiglu_limit``).
"""

from typing import Literal

import pydantic

from functrain.models.configs.hf import LayerType
from functrain.models.configs.llama import LlamaConfig
from functrain.models.configs.moe import LocalExperts
from functrain.models.configs.rope import RopeScaling
from functrain.models.family import Family

# transformers' GptOssConfig default rope_parameters (what the released checkpoints use).
GPT_OSS_YARN = RopeScaling(
    rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096
)


class GptOssConfig(LocalExperts, LlamaConfig):
    """GPT-OSS hyper-parameters, named as in HF's config.json (defaults: gpt-oss-120b's), plus the MoE options of
    :class:`LocalExperts`."""

    name: Literal["gpt_oss"] = "gpt_oss"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    vocab_size: int = pydantic.Field(201088, gt=0)
    hidden_size: int = pydantic.Field(2880, gt=0)
    intermediate_size: int = pydantic.Field(2880, gt=0)
    num_hidden_layers: int = pydantic.Field(36, gt=0)
    num_attention_heads: int = pydantic.Field(64, gt=0)
    num_key_value_heads: int | None = 8
    head_dim: int | None = 64
    max_position_embeddings: int = pydantic.Field(131072, gt=0)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150000.0
    rope_scaling: RopeScaling | None = GPT_OSS_YARN
    attention_bias: bool = True
    mlp_bias: Literal[False] = False  # not an HF GPT-OSS key: the experts' biases are always there
    sliding_window: int | None = pydantic.Field(128, gt=0)
    layer_types: tuple[LayerType, ...] | None = None
    num_local_experts: int = pydantic.Field(128, gt=0)
    num_experts_per_tok: int = pydantic.Field(4, gt=0)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = pydantic.Field(7.0, gt=0)

    @pydantic.model_validator(mode="after")
    def _layers_fit(self):
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.sliding_window is None and "sliding_attention" in self.hf_layer_types():
            raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
        return self

    def hf_layer_types(self) -> tuple[LayerType, ...]:
        """``layer_types``, or transformers' default: sliding windows on the even layers, full on the odd ones."""
        return self.layer_types or tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
        )

    @property
    def attention_sinks(self) -> bool:
        """Every attention head has a learned sink logit (``self_attn.sinks``)."""
        return True

    def attention_window(self, layer: int) -> int | None:
        """``sliding_window`` on the layers marked ``sliding_attention``, None (full) on the others."""
        return self.sliding_window if self.hf_layer_types()[layer] == "sliding_attention" else None


FAMILY = Family(
    name="gpt_oss",
    config=GptOssConfig,
    code="functrain.models.gpt_oss",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    hf_model_types=("gpt_oss",),
    hf_mapping="torch_bridge.hf.mappings:GPT_OSS",
)
