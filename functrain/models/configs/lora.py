"""The ``model.lora`` section (low-rank adapters, :mod:`functrain.models.lora`; a quantized frozen base,
:mod:`functrain.models.quantized`)."""

from typing import Literal

import pydantic

# The block sizes bitsandbytes quantizes NF4 with (``quantize_4bit``): the same set, so a base stays exportable.
NF4_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)


class LoraConfig(pydantic.BaseModel):
    """The ``model.lora`` section."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rank: int = pydantic.Field(8, gt=0)
    alpha: float = pydantic.Field(16.0, gt=0)
    dropout: float = pydantic.Field(0.0, ge=0.0, lt=1.0)
    targets: tuple[str, ...] = pydantic.Field(("q_proj", "v_proj"), min_length=1)
    # QLoRA: the frozen base's projections stored quantized (None: in the params' own dtype, as plain LoRA).
    base_dtype: Literal["nf4", "int8"] | None = None
    block_size: int = 64  # nf4: weights per absmax scale
    double_quant: bool = True  # nf4: the absmax scales quantized again to 8 bits (QLoRA's double quantization)

    @pydantic.model_validator(mode="after")
    def _nf4_options(self):
        if self.block_size not in NF4_BLOCK_SIZES:
            raise ValueError(
                f"block_size {self.block_size} is not one of bitsandbytes' NF4 block sizes; use one of "
                f"{', '.join(map(str, NF4_BLOCK_SIZES))}"
            )
        # Their defaults are allowed anywhere: a saved config (a checkpoint's meta) holds every field.
        defaults = {key: type(self).model_fields[key].default for key in ("block_size", "double_quant")}
        options = sorted(key for key, value in defaults.items() if getattr(self, key) != value)
        if options and self.base_dtype != "nf4":
            raise ValueError(
                f"{' and '.join(options)} set the NF4 quantization of the base; set base_dtype: nf4 or remove them"
            )
        return self

    @property
    def scale(self) -> float:
        """What the adapters' product is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank
