"""ZenFlow: importance-aware ZeRO-Offload at stages 1 and 2 (`ZenFlowZeroOptimizer`) and 3 (`..._Stage3`).

Layout: `schedule` (which micro steps select and which update), `columns` (DeepSpeed's per-partition
top-k column choice), `gradients` (each micro step's averaged gradient and the host accumulators),
`cpu_update` (the CPU optimizer's update, in the training process), `overlap` (the same in a worker
process), `checks` (what both loops refuse), `auto_update` (the adaptive `update_interval: "auto"`), `state`
(the selective optimizer's checkpoint state), `stage12` (the loop at ZeRO 1/2), `shards` and `stage3` (the
column choice and selective update on ZeRO-3 shards, and the loop there).
"""

from __future__ import annotations

from ds_zero._zenflow.schedule import ZenFlowSchedule
from ds_zero._zenflow.stage3 import ZenFlowZeroOptimizer_Stage3
from ds_zero._zenflow.stage12 import ZenFlowZeroOptimizer

__all__ = ["ZenFlowSchedule", "ZenFlowZeroOptimizer", "ZenFlowZeroOptimizer_Stage3"]
