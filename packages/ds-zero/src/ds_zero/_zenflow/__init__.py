"""ZenFlow: importance-aware ZeRO-Offload at stages 1 and 2 (`ZenFlowZeroOptimizer`).

Layout: `schedule` (which micro steps select and which update), `columns` (DeepSpeed's per-partition
top-k column choice), `gradients` (each micro step's averaged gradient and the host accumulators),
`cpu_update` (the CPU optimizer's update, in the training process), `overlap` (the same in a worker
process), `stage12` (the loop itself).
"""

from __future__ import annotations

from ds_zero._zenflow.schedule import ZenFlowSchedule
from ds_zero._zenflow.stage12 import ZenFlowZeroOptimizer

__all__ = ["ZenFlowSchedule", "ZenFlowZeroOptimizer"]
