"""Model options that change how a built-in model computes, never what: ``model.attention`` (the attention
kernel, :mod:`functrain.models.attention`), ``model.remat`` (:mod:`functrain.models.remat`),
``model.scan_layers`` (:mod:`functrain.models.scan`: the layers as one scan over stacked parameters) and
``model.batch_invariant`` (:mod:`functrain.models.batch_invariant`: each row's result independent of the batch and
of decoding with a cache, so that GRPO's sampler and train step compute the same log-probs; off by default).

They are config keys of every built-in model but no part of an HF config.json (see ``RUNTIME_KEYS``).
"""

from typing import Literal

import pydantic

from functrain.models import family_named, family_names
from functrain.models.configs.base import FamilyConfig

AttentionChoice = Literal["auto", "xla", "cudnn", "splash"]
RematPolicy = Literal["none", "full", "dots_saveable", "offload"]

RUNTIME_KEYS = frozenset({"attention", "remat", "scan_layers", "batch_invariant"})


def scan_refusal(model_name: str) -> str:
    """The one-line refusal of ``model.scan_layers`` for a model that does not scan its layers."""
    return (
        f"model.scan_layers is not supported by model {model_name} (only by "
        f"{', '.join(family_names('scans_layers'))}); remove model.scan_layers or set it to false"
    )


class RuntimeOptions(FamilyConfig):
    """``model.attention: auto|xla|cudnn|splash``, ``model.remat: none|full|dots_saveable|offload``,
    ``model.scan_layers: bool`` and ``model.batch_invariant: bool``."""

    attention: AttentionChoice = "auto"
    remat: RematPolicy = "none"
    scan_layers: bool = False
    batch_invariant: bool = False

    @pydantic.model_validator(mode="after")
    def _batch_invariance_supported(self):
        if self.batch_invariant and not family_named(self.name).batch_invariant:
            raise ValueError(
                f"model.batch_invariant is not supported by model {self.name} (only by "
                f"{', '.join(family_names('batch_invariant'))}); remove model.batch_invariant or set it to false"
            )
        return self

    @pydantic.model_validator(mode="after")
    def _scan_supported(self):
        if self.scan_layers and not family_named(self.name).scans_layers:
            raise ValueError(scan_refusal(self.name))
        return self

    def remat_policy(self) -> RematPolicy:
        """``model.remat``."""
        return self.remat

    def layers_scanned(self) -> bool:
        """``model.scan_layers``."""
        return self.scan_layers


def for_sampling(model_config: RuntimeOptions) -> RuntimeOptions:
    """``model_config`` with the default kernel choices: sampling (no backward pass, one token at a time) then
    runs wherever the weights load, whatever the training machine could use (cudnn, splash, host offload). Its
    layers are unrolled (the KV cache is per layer): sample with ``stacking.unstack_layers(params)``."""
    return model_config.model_copy(update={"attention": "auto", "remat": "none", "scan_layers": False})
