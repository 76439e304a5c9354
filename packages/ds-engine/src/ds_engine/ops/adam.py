"""`deepspeed.ops.adam`: `DeepSpeedCPUAdam` (vectorized CPU Adam/AdamW), `FusedAdam` (multi-tensor, CUDA or CPU)."""

from __future__ import annotations

from ds_ops import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
