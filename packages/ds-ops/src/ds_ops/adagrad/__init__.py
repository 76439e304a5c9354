"""Adagrad optimizers (DeepSpeed's `deepspeed.ops.adagrad`)."""

from __future__ import annotations

from ds_ops.adagrad._cpu_adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
