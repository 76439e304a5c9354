"""`WeightQuantizationConfig`: the top-level `weight_quantization` section (ZeRO-Inference weight quantization).

ds-zero owns it because `ds_zero.Init` is what reads it (from the ds_config it is given), as
DeepSpeed's `zero.Init` does. Only `quantized_initialization` is implemented: `Init` quantizes the weights
of `nn.Linear` / `nn.Embedding` layers built inside it (`ds_zero._construct.quantized_init`). DeepSpeed's
other key, `post_init_quant` (quantizing an already built model by swapping its layers), is refused by
key path when set. The section's own `num_bits` / `q_type` / `q_groups` are fields DeepSpeed declares but
never reads; ds accepts them at their defaults only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ds_comm import ConfigModel
from ds_zero._quantizer import GroupQuantizer

__all__ = ["QuantizedInitializationConfig", "WeightQuantizationConfig"]


class QuantizedInitializationConfig(ConfigModel):
    """`weight_quantization.quantized_initialization`: how `Init` quantizes each weight it partitions.

    DeepSpeed requires `num_bits`, `group_size` and `group_dim`; `symmetric` defaults to false (the only
    value DeepSpeed accepts; ds also allows true).
    """

    num_bits: Literal[4, 8]
    """Bits per value: 8, or 4 (two codes per byte; the weight's last dimension must be even)."""
    group_size: int = Field(gt=0)
    """Values per group (each group has its own step and minimum); must divide the weight's `group_dim` size."""
    group_dim: int = Field(ge=0)
    """The weight dimension groups run along (1: along each row of an `nn.Linear` weight)."""
    symmetric: bool = False
    """Each group's range centred on zero (`[-max|x|, max|x|]`) instead of `[min, max]`."""

    def quantizer(self) -> GroupQuantizer:
        """The group quantizer these settings describe."""
        return GroupQuantizer(self.num_bits, self.group_size, self.group_dim, self.symmetric)


class WeightQuantizationConfig(ConfigModel):
    """The `weight_quantization` section: `quantized_initialization` (implemented) and `post_init_quant` (refused)."""

    ignored_keys: ClassVar[dict[str, str]] = {
        "enabled": "DeepSpeed quantizes whenever quantized_initialization is set, whatever this says",
        "num_bits": "DeepSpeed does not read the section's own num_bits; set quantized_initialization.num_bits",
        "q_type": "DeepSpeed does not read the section's own q_type; set quantized_initialization.symmetric",
        "q_groups": "DeepSpeed does not read the section's own q_groups; set quantized_initialization.group_size",
    }

    enabled: bool = True
    """DeepSpeed's flag (it quantizes whatever its value); false with `quantized_initialization` is refused."""
    num_bits: int = 8
    q_type: Literal["symmetric", "asymmetric"] = "symmetric"
    q_groups: int = 1
    quantized_initialization: QuantizedInitializationConfig | None = None
    """Quantize weights as `Init` partitions them (absent, null or `{}`: off)."""
    post_init_quant: dict[str, Any] = Field(default_factory=dict)
    """Not implemented: must be absent or empty."""

    @field_validator("quantized_initialization", mode="before")
    @classmethod
    def _empty_is_off(cls, value: Any) -> Any:
        return None if value == {} else value

    @field_validator("post_init_quant", mode="before")
    @classmethod
    def _post_init_quant_refused(cls, value: Any) -> Any:
        if value not in (None, {}):
            raise ValueError(
                "post-init weight quantization (swapping an already built model's layers for quantized ones) is "
                "not implemented in ds; use quantized_initialization (weights quantized as zero.Init builds them)"
            )
        return {}

    @model_validator(mode="after")
    def _enabled_with_quantized_initialization(self) -> WeightQuantizationConfig:
        if not self.enabled and self.quantized_initialization is not None:
            raise ValueError(
                "enabled=false with quantized_initialization set: DeepSpeed quantizes anyway; remove "
                "quantized_initialization to turn weight quantization off"
            )
        return self
