"""`deepspeed.ops.adagrad`: `DeepSpeedCPUAdagrad` from ds-ops."""

from __future__ import annotations

from ds_ops import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
