"""`deepspeed.ops.adam`: `DeepSpeedCPUAdam` (vectorized CPU Adam/AdamW), `FusedAdam` (multi-tensor, CUDA or CPU),
ZenFlow's CPU Adam (`ZenFlowCPUAdam`) and selective AdamW for ZeRO stage 1/2 (`ZenFlowSelectiveAdamW`) and 3
(`ZenFlowSelectiveAdamW_stage3`)."""

from __future__ import annotations

from ds_ops import DeepSpeedCPUAdam, FusedAdam, ZenFlowCPUAdam, ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
