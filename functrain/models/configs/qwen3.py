"""``model.name: qwen3``: Qwen2's windows, Llama's ``attention_bias``, RMSNorm on each query and key head
(:mod:`functrain.models.qwen3`)."""

from typing import Literal

import pydantic

from functrain.models.configs.qwen2 import Qwen2Config
from functrain.models.family import Family


class Qwen3Config(Qwen2Config):
    """Qwen3 hyper-parameters, named as in HF's config.json."""

    name: Literal["qwen3"] = "qwen3"  # type: ignore[assignment]  # each family's own tag (a discriminator's Literal)
    attention_bias: bool = False  # type: ignore[assignment]  # an HF key again (Qwen2 pins it)
    head_dim: int | None = pydantic.Field(128, gt=0)  # HF's default, not hidden_size // heads

    # ``attention_bias`` covers all four projections, as on Llama (Qwen2 fixes q/k/v on and o off).
    @property
    def qkv_bias(self) -> bool:
        """Whether the q/k/v projections carry a bias."""
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        """Whether the output projection carries a bias."""
        return self.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each query and key head."""
        return True


FAMILY = Family(
    name="qwen3",
    config=Qwen3Config,
    code="functrain.models.qwen3",
    kind="causal_lm",
    scans_layers=True,
    context_parallel=True,
    pipeline=True,
    generation_cache=True,
    batch_invariant=True,
    hf_model_types=("qwen3",),
    hf_mapping="torch_bridge.hf.mappings:LLAMA",
)
