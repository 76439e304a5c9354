"""`LoRAConfig` and `QuantizationConfig`: what an `OptimizedLinear` adds to a plain linear layer.

Plain dataclasses with DeepSpeed 0.19.8's fields and defaults, so scripts that build them (and set
fields afterwards, as DeepSpeed's own tests do with `q_dtype`) keep working. Values are checked when
a layer is built from them (`check_lora_config`, `check_quantization_config`), because a field set
after construction never passes through `__init__`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, is_dataclass
from typing import cast

import torch

logger = logging.getLogger(__name__)

__all__ = ["LoRAConfig", "QuantizationConfig", "check_lora_config", "check_quantization_config"]

#: Llama-3.1's projection layers: the module names LoRA adapts unless told otherwise.
DEFAULT_TARGET_MODS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    """LoRA on a frozen base weight, optionally sharded over the data-parallel ranks.

    Attributes:
        lora_r: the adapters' rank (the inner width of `B @ A`).
        lora_alpha: the adapters' scale numerator: the output adds `(lora_alpha / lora_r) * x A^T B^T`.
        base_weight_sharding: how many ranks share the frozen base weight; each keeps 1/N of it and the
            forward all-gathers it. Must be 1 (off) or the world size.
        offload: keep the frozen base weights on the host when not in use.
        offload_ratio: the fraction of the model's base-weight elements the engine moves to the host.
        delay_lora_init: build the adapters later, with `init_lora(model)`, instead of in the constructor.
        target_mods: module names that get LoRA when a state dict is loaded into a layer built under
            `deepspeed.linear.Init`; the others turn back into plain linear layers.
    """

    lora_r: int = 64
    lora_alpha: float = 16.0
    base_weight_sharding: int = 1
    offload: bool = False
    offload_ratio: float = 0.0
    delay_lora_init: bool = False
    target_mods: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODS))


@dataclass
class QuantizationConfig:
    """Storage of a frozen base weight in a small floating-point format, dequantized in the forward.

    Attributes:
        q_bits: bits per value: 8 (FP8), 12, 6 or 4.
        mantissa_bits: mantissa bits for 8-bit values: 3 (E4M3) or 2 (E5M2). 12, 6 and 4 bits always use
            4, 2 and 1 mantissa bits.
        group_size: values that share one fp32 scale.
        q_dtype: the dtype of the packed storage (bytes).
    """

    q_bits: int = 8
    mantissa_bits: int = 3
    group_size: int = 512
    q_dtype: torch.dtype = torch.uint8


def _positive_int(value: object, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive int, got {value!r}")


def check_lora_config(config: object, argument: str = "lora_config") -> LoRAConfig:
    """`config` as a checked `LoRAConfig`; a ValueError naming `argument.<field>` and the fix otherwise."""
    if not is_dataclass(config) or not hasattr(config, "lora_r"):
        raise ValueError(f"Expecting LoRAConfig but received {type(config)} as {argument}")
    # Any dataclass with LoRAConfig's fields is accepted (DeepSpeed's own LoRAConfig included); each
    # field is checked below.
    config = cast(LoRAConfig, config)
    _positive_int(config.lora_r, f"{argument}.lora_r")
    _positive_int(config.base_weight_sharding, f"{argument}.base_weight_sharding")
    if not isinstance(config.lora_alpha, (int, float)) or isinstance(config.lora_alpha, bool):
        raise ValueError(f"{argument}.lora_alpha must be a number, got {config.lora_alpha!r}")
    ratio = config.offload_ratio
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"{argument}.offload_ratio must be a number in [0, 1], got {ratio!r}")
    if isinstance(config.target_mods, str) or not all(isinstance(m, str) for m in config.target_mods):
        raise ValueError(
            f"{argument}.target_mods must be a list of module names such as ['q_proj', 'v_proj'], "
            f"got {config.target_mods!r}"
        )
    return config


#: q_bits -> the mantissa bits DeepSpeed's FP quantizer uses for it (8 bits: the config's choice).
FIXED_MANTISSA = {12: 4, 6: 2, 4: 1}


def check_quantization_config(config: object, argument: str = "quantization_config") -> QuantizationConfig:
    """`config` as a checked `QuantizationConfig`; a ValueError naming `argument.<field>` and the fix otherwise."""
    if not is_dataclass(config) or not hasattr(config, "q_bits"):
        raise ValueError(f"Expecting QuantizationConfig but received {type(config)} as {argument}")
    # Any dataclass with QuantizationConfig's fields is accepted; each field is checked below.
    config = cast(QuantizationConfig, config)
    if config.q_bits not in (8, *FIXED_MANTISSA):
        raise ValueError(f"{argument}.q_bits must be one of 8, 12, 6, 4, got {config.q_bits!r}")
    if config.q_bits == 8 and config.mantissa_bits not in (2, 3):
        raise ValueError(
            f"{argument}.mantissa_bits must be 3 (E4M3) or 2 (E5M2) for q_bits=8, got {config.mantissa_bits!r}"
        )
    _positive_int(config.group_size, f"{argument}.group_size")
    if config.group_size * config.q_bits % 8 or config.group_size % 4:
        raise ValueError(
            f"{argument}.group_size must be a multiple of 4 (whole bytes per group at any q_bits), "
            f"got {config.group_size!r}"
        )
    if config.q_dtype != torch.uint8:
        raise ValueError(f"{argument}.q_dtype must be torch.uint8 (packed bytes), got {config.q_dtype!r}")
    return config
