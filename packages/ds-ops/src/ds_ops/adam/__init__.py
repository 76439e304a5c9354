"""Adam optimizers (DeepSpeed's `deepspeed.ops.adam`): DeepSpeedCPUAdam for CPU tensors, FusedAdam for CUDA or CPU."""

from __future__ import annotations

from ds_ops.adam._cpu_adam import DeepSpeedCPUAdam
from ds_ops.adam._fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
