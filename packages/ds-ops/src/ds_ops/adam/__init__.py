"""Adam optimizers (DeepSpeed's `deepspeed.ops.adam`): DeepSpeedCPUAdam for CPU tensors."""

from __future__ import annotations

from ds_ops.adam._cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
