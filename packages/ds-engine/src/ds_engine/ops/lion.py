"""`deepspeed.ops.lion`: `DeepSpeedCPULion` from ds-ops."""

from __future__ import annotations

from ds_ops import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
