"""Any ``torch.nn.Module`` as the pure step's loss: user models, user losses, the built-in losses.

A user module trains with its own parameters and buffers (``named_parameters()`` / ``named_buffers()``,
checkpointed under those names; tied weights stay tied, see :func:`torch_bridge.models.stateless`).
Buffers a module updates in place (BatchNorm's running statistics) are model state: the step hands the
module clones and keeps the updated clones.

The loss contract mirrors the JAX one, ``loss_fn(params, batch, rng) -> (loss_sum, weight, aux_sums)``,
with the module in place of ``params`` and a ``torch.Generator`` in place of ``rng``::

    def loss_fn(model: nn.Module, batch: dict[str, Tensor], generator: torch.Generator | None
                ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        logits = model(batch["x"])                           # the step's parameters are bound to `model`
        losses = F.cross_entropy(logits, batch["y"].long(), reduction="none")
        return (losses * batch["weight"]).sum(), batch["weight"].sum(), {}

Sums, never means: the step divides once by the total weight over micro-batches and processes, so
accumulation is exact. ``generator`` is None in evaluation (the module is then in ``eval()`` mode, in
``train()`` mode for training steps). Without a ``loss_fn`` the loss follows the data's fields
(:mod:`functrain.core.fields`: the conventions, or ``data.fields``): ``tokens`` get the causal-LM loss of
``model(tokens[:, :-1])``; HF ``input_ids`` (with ``labels``, ``-100`` not counted, and ``attention_mask``)
the same loss of ``model(input_ids=input_ids[:, :-1], attention_mask=attention_mask[:, :-1])`` (by keyword
when ``forward`` names them); a classifier input (``x``, ``image``, ...) with labels the classifier loss of
``model(inputs)``. The output may be logits or an object with ``.logits`` (transformers).
Packed batches (``segment_ids``/``positions``) keep documents apart as the JAX side does: the module gets a
block-diagonal causal ``attention_mask`` ``[B, 1, T, T]`` in the form transformers 5 takes as given (bool,
True = attend; additive float for ``config._attn_implementation == "eager"``) and restarting
``position_ids``; a module whose ``forward`` does not take both is refused (see :func:`packing_keywords`).

Randomness inside a module (dropout) draws from torch's global generator, which the step seeds from
``(seed, step, micro-batch, rank)`` before each call, so a resumed run draws what an uninterrupted one does.
"""

import functools
import inspect
import sys
from typing import Any, Callable, Mapping, cast

import torch
from torch import nn

from functrain.core.fields import Fields, canonical
from functrain.errors import ConfigError
from functrain.models.configs.base import DecoderShape
from torch_bridge.models import binder, block_causal_mask, causal_lm_sums, classifier_sums, loss_for
from torch_bridge.step import LossFn, LossOutput, Params

Tensor = torch.Tensor
UserLoss = Callable[[nn.Module, Mapping[str, Tensor], "torch.Generator | None"], LossOutput]

# Decorrelates the global generator's stream from the step generator's (both derive from one seed).
GLOBAL_RNG_SALT = 0x2545F4914F6CDD1D


def build_module(factory: Callable[..., Any], seed: int, **kwargs: Any) -> nn.Module:
    """``factory(**kwargs)`` under torch's global RNG seeded with ``seed``, checked to be an ``nn.Module``.

    The seed makes a factory's random initialisation (e.g. ``GPT2LMHeadModel(config)``) the same in every
    run of a config, so two runs of it start from the same weights; the caller's RNG state is restored.
    """
    name = getattr(factory, "__qualname__", repr(factory))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = factory(**kwargs)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"model factory {name} returned {type(module).__name__}, not a torch.nn.Module; "
            f"return the module (backend: torch)"
        )
    return module


def logits_of(output: Any, model: nn.Module) -> Tensor:
    """The logits of a module's output: a tensor, ``.logits`` (transformers) or ``["logits"]``."""
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", output)
    if not isinstance(logits, Tensor):
        raise ConfigError(
            f"{type(model).__name__} returned {type(output).__name__}, not logits; the built-in "
            f"losses need a tensor or an output with .logits: return logits or pass loss_fn="
        )
    return logits


def _check_shape(logits: Tensor, expected: tuple[int, ...], what: str, model: nn.Module) -> None:
    if logits.ndim != len(expected) + 1 or tuple(logits.shape[:-1]) != expected:
        needed = ", ".join([*map(str, expected), "classes"])
        raise ConfigError(
            f"{type(model).__name__} returned logits of shape {tuple(logits.shape)}; the built-in "
            f"{what} loss needs [{needed}] for this batch: return such logits or pass loss_fn="
        )


# The keyword arguments through which a module can keep packed documents apart.
PACKING_ARGUMENTS = ("attention_mask", "position_ids")


def _forward_parameters(model: nn.Module) -> set[str]:
    """The named parameters of the module's forward (through a torch.compile wrapper to the module)."""
    return set(inspect.signature(getattr(model, "_orig_mod", model).forward).parameters)


def packing_keywords(model: nn.Module, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``attention_mask`` and ``position_ids`` that keep a packed batch's documents apart; ``{}`` unpacked.

    The mask is :func:`torch_bridge.models.block_causal_mask` of the input tokens' segments: bool for SDPA-style
    attention, additive float32 (0 or the float32 minimum, as transformers' own eager mask) when the module's
    ``config._attn_implementation`` is ``eager``, which adds it to the scores. A module whose ``forward`` does
    not name both arguments would attend or count positions across documents: a one-line ConfigError (the
    backend probes the loss on an example batch, so this fires before the first step).
    """
    if "segment_ids" not in batch:
        return {}
    missing = [name for name in PACKING_ARGUMENTS if name not in _forward_parameters(model)]
    if missing:
        raise ConfigError(
            f"packed batches (data.packing: true) need {type(model).__name__}.forward to take "
            f"attention_mask and position_ids, and it lacks {' and '.join(missing)}; set "
            f"data.packing=false or pass loss_fn= that keeps documents apart"
        )
    mask = block_causal_mask(batch["segment_ids"][:, :-1])
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager":
        blocked = torch.finfo(torch.float32).min
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill(~mask, blocked)
    return {"attention_mask": mask, "position_ids": batch["positions"][:, :-1].long()}


def call(model: nn.Module, inputs: Tensor, argument: str | None, **keywords: Any) -> Any:
    """``model`` on its inputs: positionally, or as the keyword ``argument`` (a field map's)."""
    return model(**{argument: inputs}, **keywords) if argument else model(inputs, **keywords)


def hf_call(model: nn.Module, inputs: Tensor, batch: Mapping[str, Tensor], argument: str | None) -> Any:
    """``model`` on HF fields: ``input_ids`` (and the ``attention_mask`` of the inputs, when the batch has one)
    by keyword where ``forward`` names them, else the ids positionally (the mask then only stops counting)."""
    parameters = _forward_parameters(model)
    keywords = {}
    if "attention_mask" in batch and "attention_mask" in parameters:
        keywords["attention_mask"] = batch["attention_mask"][:, :-1].long()
    if argument is None and "input_ids" in parameters:
        argument = "input_ids"
    return call(model, inputs, argument, **keywords)


def default_causal_lm_loss(
    model: nn.Module, batch: Mapping[str, Tensor], generator: torch.Generator | None, argument: str | None = None
) -> LossOutput:
    """The built-in loss for LM batches (under the names of :func:`functrain.core.fields.canonical`):
    next-token cross-entropy of ``model(tokens[:, :-1])``, with :func:`packing_keywords` for packed batches
    (targets that start a document do not count), :func:`hf_call` for HF ones."""
    inputs = batch["tokens"].long()[:, :-1]
    hf = "labels" in batch or "attention_mask" in batch
    balanced = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    if balanced and "segment_ids" in batch:
        raise ConfigError(
            f"{type(model).__name__} adds its load-balancing loss (output_router_logits), which transformers "
            f"computes from a 2-D padding mask, not a packed batch's; set data.packing=false"
        )
    output = (
        hf_call(model, inputs, batch, argument)
        if hf
        else call(model, inputs, argument, **packing_keywords(model, batch))
    )
    logits = logits_of(output, model)
    _check_shape(logits, tuple(inputs.shape), "causal-LM", model)
    loss_sum, weight, aux = causal_lm_sums(logits, batch)
    if balanced:
        return with_balancing_loss(model, output, loss_sum, weight, aux)
    return loss_sum, weight, aux


def with_balancing_loss(model: nn.Module, output: Any, loss_sum: Tensor, weight: Tensor, aux: dict) -> LossOutput:
    """A transformers mixture of experts' sums with its load-balancing loss added as its own forward adds it
    with ``output_router_logits`` (``router_aux_loss_coef x aux_loss``, over this forward's tokens: transformers'
    micro-batch scope), times the weight so that the step's one division leaves it whole; ``moe/aux_loss``
    unweighted in the metrics."""
    aux_loss = getattr(output, "aux_loss", None)
    if not isinstance(aux_loss, Tensor):
        raise ConfigError(
            f"{type(model).__name__} sets output_router_logits but its output has no aux_loss; set "
            f"output_router_logits=false in its config or pass loss_fn= that adds the balancing loss"
        )
    scaled = aux_loss * weight
    coefficient = float(getattr(model, "config").router_aux_loss_coef)  # noqa: B009 (nn.Module types attributes as Tensor | Module)
    return loss_sum + coefficient * scaled, weight, {**aux, "moe/aux_loss": scaled}


def default_classifier_loss(
    model: nn.Module, batch: Mapping[str, Tensor], generator: torch.Generator | None, argument: str | None = None
) -> LossOutput:
    """The built-in loss for ``x``/``y`` batches: softmax cross-entropy of ``model(x)`` (or
    ``model(argument=x)``)."""
    logits = logits_of(call(model, batch["x"], argument), model)
    _check_shape(logits, (batch["x"].shape[0],), "classifier", model)
    return classifier_sums(logits, batch)


def default_loss(fields: Fields) -> UserLoss:
    """The built-in loss for the data's ``fields`` (resolved by the builder), reading them under the loss's
    own names."""
    loss = default_causal_lm_loss if fields.kind == "causal_lm" else default_classifier_loss

    def builtin(model: nn.Module, batch: Mapping[str, Tensor], generator: torch.Generator | None) -> LossOutput:
        return loss(model, canonical(fields, batch), generator, fields.argument)

    return builtin


def trainable_module(model: Any) -> nn.Module:
    """A user's module, checked, with what training never uses switched off (a transformers model's cache)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model= is a {type(model).__name__}; backend: torch takes a torch.nn.Module "
            f"(build it first, e.g. with torch_bridge.user_model.build_module)"
        )
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"model {type(model).__name__} has no parameters to train; pass a module with parameters")
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    return model


def decoder_shape(model: nn.Module) -> DecoderShape | None:
    """The FLOPs formula's shape (MFU in the logs) of a transformers decoder, read from its ``config`` under
    the names every transformers config answers to (``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``vocab_size``; GPT-2's ``n_layer`` and the like map onto them), with
    ``num_key_value_heads``, ``head_dim`` and ``intermediate_size`` (a gated MLP) where the family has them.
    None for a module that is no transformers model: functrain does not guess the shape of a user's own."""
    transformers = sys.modules.get("transformers")  # imported already wherever a transformers model exists
    config = getattr(model, "config", None)
    if transformers is None or not isinstance(config, transformers.PretrainedConfig):
        return None
    layers, width, heads, vocab = (
        getattr(config, key, None) for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    )
    if not (layers and width and heads and vocab):
        return None
    mlp_width = getattr(config, "intermediate_size", None)
    return DecoderShape(
        layers=layers,
        width=width,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or width // heads,
        mlp_width=mlp_width or 4 * width,
        mlp_matrices=2 if mlp_width is None else 3,
        vocab=vocab,
    )


def step_loss(
    model: nn.Module, *, builtin: bool, loss_fn: UserLoss | None, fields: Fields | None, torch_compile: bool = False
) -> LossFn:
    """The step's loss: a twin's own (``builtin``, no ``loss_fn``), or ``loss_fn`` (default: the built-in one
    for the data's ``fields``) on the module, through ``torch.compile`` with ``torch_compile``."""
    if builtin and loss_fn is None:
        if torch_compile:
            raise ConfigError(
                f"train.torch_compile=true compiles a user nn.Module (fit(..., model=) or "
                f"model.target); the built-in {type(model).__name__.lower()} twin runs eagerly: "
                f"remove train.torch_compile"
            )
        return twin_loss(loss_for(model), fields)
    if loss_fn is None:
        assert fields is not None, "the builder resolves the data's fields for the built-in loss"
        loss_fn = default_loss(fields)
    return module_loss(model, loss_fn, compiled(model) if torch_compile else None)


def twin_loss(loss: LossFn, fields: Fields | None) -> LossFn:
    """A twin's ``loss(params, buffers, batch, generator)`` reading the data's ``fields`` under its own names."""
    if fields is None:
        return loss

    @functools.wraps(loss)
    def renamed(
        params: Params, buffers: Params, batch: Mapping[str, Tensor], generator: torch.Generator | None
    ) -> LossOutput:
        return loss(params, buffers, canonical(fields, batch), generator)

    return renamed


def compiled(model: nn.Module) -> nn.Module:
    """``model`` behind ``torch.compile`` (``train.torch_compile``), for the training step's forward.

    Inductor's ``fallback_random`` makes dropout draw from torch's global generator as eager code does, so
    the compiled step sees the same masks as the uncompiled one (equal within float rounding) and a resumed
    run the same numbers as an uninterrupted one. The wrapper shares the module's parameter tables, so
    :func:`torch_bridge.models.binder` binds the step's tensors for it too; they are graph inputs, so new
    tensors every step do not recompile.
    """
    # An OptimizedModule (an nn.Module) at run time; torch's stub types the result as a plain function.
    return cast(nn.Module, torch.compile(model, options={"fallback_random": True}))


def module_loss(model: nn.Module, loss_fn: UserLoss, compiled_model: nn.Module | None = None) -> LossFn:
    """The pure step's ``loss(params, buffers, batch, generator)`` for a module and a user-contract loss.

    During the call ``model`` holds ``params`` and ``buffers`` (restored afterwards), is in train mode when
    ``generator`` is given and eval mode when it is None, and torch's global RNG is seeded from ``generator``.
    ``compiled_model`` (see :func:`compiled`), when given, is what ``loss_fn`` gets in training calls;
    evaluation stays eager (a second compilation for a few evaluation batches would not pay for itself).
    """
    bind = binder(model)

    @functools.wraps(loss_fn)  # errors about the loss name the user's function
    def loss(
        params: Mapping[str, Tensor],
        buffers: Mapping[str, Tensor],
        batch: Mapping[str, Tensor],
        generator: torch.Generator | None,
    ) -> LossOutput:
        training = generator is not None
        if model.training != training:
            model.train(training)
        if generator is not None:  # training
            seed = generator.initial_seed() ^ GLOBAL_RNG_SALT
            if generator.device.type == "cuda":
                torch.cuda.manual_seed(seed)
            else:
                torch.default_generator.manual_seed(seed)
        with bind(params, buffers):
            return loss_fn(compiled_model if training and compiled_model is not None else model, batch, generator)

    return loss
