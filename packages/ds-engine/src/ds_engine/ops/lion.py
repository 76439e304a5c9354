"""`deepspeed.ops.lion`: `DeepSpeedCPULion` from ds-ops and `FusedLion`, the `lion` config's optimizer."""

from __future__ import annotations

from ds_engine._optim.torch_optimizers import FusedLion
from ds_ops import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion", "FusedLion"]
