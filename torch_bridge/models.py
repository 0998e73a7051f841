"""PyTorch twins of functrain's Flax MLP and char GPT, their losses, and weight conversion from Flax.

Module and parameter names follow the Flax models (``dense_0.weight`` is Flax ``dense_0/kernel``
transposed), so :func:`params_from_flax` is a rename plus a transpose, and a run can start both
frameworks from the same weights. Layer choices match the Flax code: LayerNorm epsilon 1e-6, tanh-GELU,
pre-norm blocks, learned positions, untied bias-free head. Dropout draws only from the generator the
step passes in (``None`` = evaluation: no dropout), never from the global torch RNG. Packed batches work as
on the JAX side: the GPT takes ``segment_ids``/``positions`` (attention stays within a document, position
embeddings restart), and the losses apply the shared policy of :mod:`functrain.core.losses`.
"""

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from functrain.core.losses import (
    ArrayOps,
    example_weights,
    label_hits,
    lm_targets,
    model_keywords,
    target_weights,
    weighted_sums,
)
from functrain.core.tree import flatten_dotted

Tensor = torch.Tensor
LN_EPS = 1e-6  # flax.linen.LayerNorm's default; torch's default is 1e-5


def dropout(x: Tensor, rate: float, generator: torch.Generator | None) -> Tensor:
    """Inverted dropout drawing from ``generator``; the identity when it is None or ``rate`` is 0."""
    if generator is None or rate == 0.0:
        return x
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) >= rate
    return torch.where(keep, x / (1.0 - rate), torch.zeros_like(x))


def block_causal_mask(segment_ids: Tensor) -> Tensor:
    """``[B, 1, T, T]`` bool, True where a query may attend to a key: causal and within its segment."""
    length = segment_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    return ((segment_ids[:, :, None] == segment_ids[:, None, :]) & causal)[:, None]


def _lecun_normal_(weight: Tensor, fan_in: int, generator: torch.Generator) -> None:
    """Flax's lecun_normal: truncated normal (±2 sd) rescaled so the variance is 1 / fan_in."""
    std = math.sqrt(1.0 / fan_in) / 0.87962566103423978  # sd of a unit normal truncated at ±2
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std, generator=generator)


class MLP(nn.Module):
    """Linear + ReLU layers, then a linear head (``functrain.models.mlp.MLP``)."""

    def __init__(self, in_features: int, hidden: list[int], num_classes: int) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        self.hidden_names = [f"dense_{i}" for i in range(len(hidden))]
        for name, fan_in, width in zip(self.hidden_names, widths[:-1], widths[1:]):
            self.add_module(name, nn.Linear(fan_in, width))
        self.head = nn.Linear(widths[-1], num_classes)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """Flax's initialisers: lecun-normal kernels, zero biases."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _lecun_normal_(module.weight, module.in_features, generator)
                nn.init.zeros_(module.bias)

    def forward(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        for name in self.hidden_names:
            x = F.relu(getattr(self, name)(x))
        return self.head(x)


class Block(nn.Module):
    """Pre-LayerNorm block: causal self-attention, then a tanh-GELU MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout_rate: float) -> None:
        super().__init__()
        self.n_heads, self.dropout_rate = n_heads, dropout_rate
        self.ln_attn = nn.LayerNorm(d_model, eps=LN_EPS)
        self.query, self.key, self.value = (nn.Linear(d_model, d_model) for _ in range(3))
        self.attn_out = nn.Linear(d_model, d_model)
        self.ln_mlp = nn.LayerNorm(d_model, eps=LN_EPS)
        self.mlp_in = nn.Linear(d_model, d_ff)
        self.mlp_out = nn.Linear(d_ff, d_model)

    def forward(self, x: Tensor, generator: torch.Generator | None, mask: Tensor | None = None) -> Tensor:
        """``mask``: a :func:`block_causal_mask` for packed rows; None is plain causal attention."""
        batch, length, d_model = x.shape
        h = self.ln_attn(x)
        query, key, value = (
            proj(h).view(batch, length, self.n_heads, -1).transpose(1, 2) for proj in (self.query, self.key, self.value)
        )
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None)
        attended = self.attn_out(attended.transpose(1, 2).reshape(batch, length, d_model))
        x = x + dropout(attended, self.dropout_rate, generator)
        h = self.mlp_out(F.gelu(self.mlp_in(self.ln_mlp(x)), approximate="tanh"))
        return x + dropout(h, self.dropout_rate, generator)


class GPT(nn.Module):
    """Token + learned position embeddings, blocks, a final norm, an untied head (``functrain.models.gpt``)."""

    def __init__(
        self,
        vocab_size: int,
        max_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        dropout_rate: float = 0.0,
    ) -> None:
        super().__init__()
        self.dropout_rate, self.n_layers = dropout_rate, n_layers
        self.token_embed = nn.Embedding(vocab_size, d_model)
        self.position_embed = nn.Parameter(torch.zeros(max_len, d_model))
        self.block_names = [f"block_{i}" for i in range(n_layers)]
        for name in self.block_names:
            self.add_module(name, Block(d_model, n_heads, d_ff, dropout_rate))
        self.ln_final = nn.LayerNorm(d_model, eps=LN_EPS)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def reset_parameters(self, generator: torch.Generator) -> None:
        """The Flax GPT's initialisers: N(0, 0.02), residual outputs N(0, 0.02 / sqrt(2 n_layers))."""
        out_std = 0.02 / math.sqrt(2 * self.n_layers)
        for name, param in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith(("ln_attn.weight", "ln_mlp.weight", "ln_final.weight")):
                nn.init.ones_(param)
            elif leaf == "bias":
                nn.init.zeros_(param)
            else:
                std = out_std if name.endswith(("attn_out.weight", "mlp_out.weight")) else 0.02
                nn.init.normal_(param, std=std, generator=generator)

    def forward(
        self,
        tokens: Tensor,
        generator: torch.Generator | None = None,
        *,
        segment_ids: Tensor | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, T, vocab]``; ``segment_ids``/``positions`` ``[B, T]`` as in the Flax GPT (packed rows)."""
        table = self.position_embed
        position = table[: tokens.shape[1]] if positions is None else table[positions.long()]
        x = dropout(self.token_embed(tokens) + position, self.dropout_rate, generator)
        mask = None if segment_ids is None else block_causal_mask(segment_ids)
        for name in self.block_names:
            x = getattr(self, name)(x, generator, mask)
        return self.head(self.ln_final(x))


# ------------------------------------------------------------------------------------- stateless calls


def stateless(model: nn.Module) -> Callable[..., Any]:
    """``apply(params, buffers, *args, **kwargs)``: run ``model`` with the given tensors in place of its own.

    The semantics of ``torch.func.functional_call(model, (params, buffers), args, kwargs, tie_weights=True)``
    for a fixed module, at a fraction of the per-call cost (which dominates small models): the owning
    submodule of every name is looked up once, and a call only swaps dictionary entries and swaps them back.
    Tied tensors stay tied: a tensor reachable under several names (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``) is given once, under the name ``named_parameters()`` lists, and every alias
    receives it. Names absent from ``params``/``buffers`` keep the module's own tensors.
    """
    bind = binder(model)

    def apply(params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], *args: Any, **kwargs: Any) -> Any:
        with bind(params, buffers):
            return model(*args, **kwargs)

    return apply


def binder(model: nn.Module) -> Callable[[Mapping[str, Tensor], Mapping[str, Tensor]], Any]:
    """``bind(params, buffers)``: a context in which ``model`` holds the given tensors (see :func:`stateless`)."""
    slots = []  # (owner's table, attribute, canonical name): every name a tensor is reachable under
    canonical: dict[int, str] = {}
    for kind, named in (
        ("_parameters", model.named_parameters(remove_duplicate=False)),
        ("_buffers", model.named_buffers(remove_duplicate=False)),
    ):
        for name, tensor in named:
            owner_name, _, attr = name.rpartition(".")
            # The first name of a tensor is the one named_parameters()/named_buffers() list (their de-duplication).
            slots.append((getattr(model.get_submodule(owner_name), kind), attr, canonical.setdefault(id(tensor), name)))

    @contextlib.contextmanager
    def bind(params: Mapping[str, Tensor], buffers: Mapping[str, Tensor]) -> Iterator[None]:
        saved = []
        try:
            for table, attr, name in slots:
                value = params.get(name, buffers.get(name))
                if value is not None:
                    saved.append((table, attr, table[attr]))
                    table[attr] = value
            yield
        finally:
            for table, attr, original in reversed(saved):
                table[attr] = original

    return bind


# ------------------------------------------------------------------------------------------------- losses

TORCH_OPS = ArrayOps(as_float=lambda x: x.to(torch.float32), broadcast_to=torch.broadcast_to)


def _hits(logits: Tensor, labels: Tensor) -> Tensor:
    """The shared accuracy rule (``functrain.core.losses.label_hits``) on torch logits."""
    return label_hits(logits.gather(-1, labels[..., None]).squeeze(-1), logits.amax(-1))


def classifier_sums(logits: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Weighted softmax cross-entropy of ``logits [B, classes]`` against ``batch["y"]``; aux: correct count."""
    labels = batch["y"].long()
    losses = F.cross_entropy(logits, labels, reduction="none")
    return weighted_sums(losses, _hits(logits, labels), example_weights(batch, TORCH_OPS), TORCH_OPS)


def causal_lm_sums(logits: Tensor, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Next-token cross-entropy of ``logits [B, T-1, vocab]`` (the model's output for ``tokens[:, :-1]``)
    summed over the targets that count (``functrain.core.losses.target_weights``: weight, mask, segments, HF
    ``labels`` of -100 and ``attention_mask``)."""
    targets = lm_targets(batch).long()
    losses = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    return weighted_sums(losses, _hits(logits, targets), target_weights(batch, TORCH_OPS), TORCH_OPS)


def classifier_loss(model: nn.Module) -> Callable:
    """``loss_fn(params, buffers, batch, generator)``: :func:`classifier_sums` of the model's logits."""
    apply = stateless(model)

    def loss_fn(params, buffers, batch, generator):
        return classifier_sums(apply(params, buffers, batch["x"], generator=generator), batch)

    return loss_fn


def causal_lm_loss(model: nn.Module) -> Callable:
    """``loss_fn(params, buffers, batch, generator)``: :func:`causal_lm_sums` of the model's logits; a packed
    batch's ``segment_ids``/``positions`` of the input tokens go to the model (as on the JAX side)."""
    apply = stateless(model)

    def loss_fn(params, buffers, batch, generator):
        # As on the JAX side (core.program), an HF padding mask reaches the twin as two segments: no real
        # token attends to a padded key.
        keywords = model_keywords("causal_lm", batch)
        if "attention_mask" in keywords:
            keywords.setdefault("segment_ids", keywords.pop("attention_mask"))
        logits = apply(params, buffers, batch["tokens"].long()[:, :-1], generator=generator, **keywords)
        return causal_lm_sums(logits, batch)

    return loss_fn


def loss_for(model: nn.Module) -> Callable:
    """The loss of a twin (:func:`torch_bridge.twins.twin_model`)."""
    return causal_lm_loss(model) if isinstance(model, GPT) else classifier_loss(model)


# ------------------------------------------------------------------------------------ Flax weight import

# torch's dotted names for a Flax-style parameter tree.
flatten = flatten_dotted


def _convert(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """One Flax leaf -> (torch name, torch layout)."""
    path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    torch_path = f"{path}." if path else ""
    if leaf == "kernel":
        # Dense (in, out); DenseGeneral (in, heads, head_dim) or (heads, head_dim, out): fold the head axes
        # into the side they belong to, then transpose to torch's (out, in).
        if path.endswith("attn_out"):
            value = value.reshape(-1, value.shape[-1])
        else:
            value = value.reshape(value.shape[0], -1)
        return torch_path + "weight", value.T
    if leaf == "bias":
        return torch_path + "bias", value.reshape(-1)
    if leaf in ("scale", "embedding"):
        return torch_path + "weight", value
    return name, value


def params_from_flax(flax_params: Mapping) -> dict[str, Tensor]:
    """A Flax MLP/GPT params tree -> the torch twin's state dict (float32 tensors, contiguous)."""
    return {
        name: torch.tensor(np.asarray(value, dtype=np.float32))
        for name, value in (_convert(n, np.asarray(v)) for n, v in flatten(flax_params).items())
    }
