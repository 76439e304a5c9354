"""ds's `OptimizedLinear`: LoRA over frozen base weights that are sharded over the ranks and/or quantized.

`deepspeed.linear` (DeepSpeed's path) is this package. Nothing here reads the ds_config: layers are
built by the user (or under `Init`) from `LoRAConfig` / `QuantizationConfig`; the engine only finds them
(to skip their base weights in the initial broadcast and to apply `offload_ratio`).
Needs torch and ds-comm (the all-gather of sharded base weights) only.
"""

from __future__ import annotations

from ds_engine._linear.config import LoRAConfig, QuantizationConfig
from ds_engine._linear.context_manager import Init, init_lora
from ds_engine._linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear
from ds_engine._linear.quantization import QuantizedLinear, QuantizedParameter

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
