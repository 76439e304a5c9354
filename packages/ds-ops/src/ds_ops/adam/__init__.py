"""Adam optimizers (DeepSpeed's `deepspeed.ops.adam`): DeepSpeedCPUAdam for CPU tensors, FusedAdam for CUDA or CPU,
ZenFlow's CPU Adam (`ZenFlowCPUAdam`, bias correction by micro step) and its selective AdamW (Adam on the
selected columns of each parameter) for ZeRO stage 1/2 and 3."""

from __future__ import annotations

from ds_ops.adam._cpu_adam import DeepSpeedCPUAdam
from ds_ops.adam._fused_adam import FusedAdam
from ds_ops.adam._zenflow_cpu_adam import ZenFlowCPUAdam
from ds_ops.adam._zenflow_selective import ZenFlowSelectiveAdamW
from ds_ops.adam._zenflow_selective_stage3 import ZenFlowSelectiveAdamW_stage3

__all__ = ["DeepSpeedCPUAdam", "FusedAdam", "ZenFlowCPUAdam", "ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3"]
