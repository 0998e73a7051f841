"""Model options that change how a built-in model computes, never what: ``model.attention`` (the attention
kernel, :mod:`functrain.models.attention`) and ``model.remat`` (:mod:`functrain.models.remat`).

They are config keys of every built-in model but no part of an HF config.json (see ``RUNTIME_KEYS``).
"""

import pydantic

from functrain.models.attention import AttentionChoice
from functrain.models.remat import RematPolicy

RUNTIME_KEYS = frozenset({"attention", "remat"})


class RuntimeOptions(pydantic.BaseModel):
    """``model.attention: auto|xla|cudnn|splash`` and ``model.remat: none|full|dots_saveable|offload``."""

    attention: AttentionChoice = "auto"
    remat: RematPolicy = "none"


def for_sampling(model_config: RuntimeOptions) -> RuntimeOptions:
    """``model_config`` with the default kernel choices: sampling (no backward pass, one token at a time) then
    runs wherever the weights load, whatever the training machine could use (cudnn, splash, host offload)."""
    return model_config.model_copy(update={"attention": "auto", "remat": "none"})
