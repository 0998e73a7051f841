"""What the rest of functrain asks of any model config, as methods: the data checks (context, vocabulary,
classes), the FLOPs formula (:class:`DecoderShape`, for MFU and ``functrain plan``), LoRA, remat and the
scanned layers. Each family answers for itself; the defaults here are the answers of a model functrain knows
nothing about (``None``: not known, or not that kind of model), which user models (``model.target``, a model
passed to ``fit``) keep.
"""

from dataclasses import dataclass
from typing import Hashable

import pydantic

from functrain.models.configs.lora import LoraConfig


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a decoder-only transformer the FLOPs formula needs (:mod:`functrain.report.mfu`)."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int  # a mixture of experts: the active width, k x each expert's (+ the shared experts')
    mlp_matrices: int  # 3 for a gated MLP (SwiGLU, GeGLU), 2 for a plain one
    vocab: int
    router_width: int = 0  # a mixture of experts: the router's outputs (its experts, + a shared expert's gate)
    # Latent attention (DeepSeek): the attention projections' parameters a layer (None: Llama's, from the heads) and
    # the values' head width where it is not the queries' and keys' (None: head_dim).
    attention_params: int | None = None
    value_head_dim: int | None = None
    # Hybrid stacks (Qwen3-Next, Qwen3.5): the layers of softmax attention over the context (None: every layer), and
    # the forward FLOPs per token the other layers' token mixing adds beyond their projections (Gated DeltaNet's
    # delta rule and convolution), summed over those layers.
    attention_layers: int | None = None
    mixer_flops: float = 0.0


class ModelConfig(pydantic.BaseModel):
    """Base of every ``model`` section: a registered family's config, ``model.target`` or a model given to
    ``fit``."""

    def registry_name(self) -> str | None:
        """The family's ``model.name`` in the registry; None for a user model."""
        return None

    def max_positions(self) -> int | None:
        """How many positions the model attends over (``data.seq_len`` and prompts must fit); None: no limit."""
        return None

    def vocabulary_size(self) -> int | None:
        """The number of token ids the model embeds (ids lie below it); None for models that read no tokens."""
        return None

    def class_count(self) -> int | None:
        """The number of classes a classifier scores (labels lie below it); None for other models."""
        return None

    def decoder_shape(self) -> DecoderShape | None:
        """The model's shape for the FLOPs formula; None for models that are not decoder-only transformers."""
        return None

    def lora_settings(self) -> LoraConfig | None:
        """The low-rank adapters the run trains on this model (``model.lora``); None: the whole model trains."""
        return None

    def remat_policy(self) -> str | None:
        """What the backward pass recomputes (``model.remat``); None for models without that option."""
        return None

    def layers_scanned(self) -> bool:
        """Whether the layers run as one scan over stacked parameters (``model.scan_layers``)."""
        return False

    def layer_kinds(self) -> list[Hashable] | None:
        """What sets each layer apart (its attention window, ...), one entry a layer, as the module passes
        ``kinds`` to :func:`functrain.models.scan.apply_layers`; None for models whose layers do not scan."""
        return None

    def pipelined_layer_kinds(self) -> list[Hashable] | None:
        """The kinds of the layers pipeline stages split (``mesh.pipeline``): every layer, unless the family runs
        some outside the pipeline; None for models whose layers do not scan."""
        return self.layer_kinds()


class FamilyConfig(ModelConfig):
    """A registered family's config: ``name`` (each family narrows it to its own) selects it in the union."""

    name: str

    def registry_name(self) -> str:
        """The family's ``model.name``."""
        return self.name
