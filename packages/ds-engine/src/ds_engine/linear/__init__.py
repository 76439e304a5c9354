"""`deepspeed.linear`: ds's `OptimizedLinear`, `LoRAConfig`, `QuantizationConfig`, `Init`, `init_lora` (`_linear/`)."""

from __future__ import annotations

from ds_engine._linear import (
    Init,
    LoRAConfig,
    LoRAOptimizedLinear,
    OptimizedLinear,
    QuantizationConfig,
    QuantizedLinear,
    QuantizedParameter,
    init_lora,
)

__all__ = [
    "Init",
    "LoRAConfig",
    "LoRAOptimizedLinear",
    "OptimizedLinear",
    "QuantizationConfig",
    "QuantizedLinear",
    "QuantizedParameter",
    "init_lora",
]
