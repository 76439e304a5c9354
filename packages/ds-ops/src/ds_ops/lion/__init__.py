"""Lion optimizers (DeepSpeed's `deepspeed.ops.lion`)."""

from __future__ import annotations

from ds_ops.lion._cpu_lion import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
