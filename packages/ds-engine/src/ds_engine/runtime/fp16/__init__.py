"""`deepspeed.runtime.fp16`: the 16-bit optimizer wrapper and the loss scalers under DeepSpeed's module paths.

DeepSpeed has two fp16 wrappers (`fused_optimizer.FP16_Optimizer`, flat fp32 master buffers, and
`unfused_optimizer.FP16_UnfusedOptimizer`, per-parameter ones); ds has one, `MixedPrecisionOptimizer`
(per-parameter fp32 masters and one flat gradient buffer), which both names stand for, so
`isinstance(engine.optimizer, FP16_Optimizer)` is True for an fp16 or bf16 engine at stage 0.
`loss_scaler` holds ds-ops' `LossScaler` and `DynamicLossScaler`.
"""

from __future__ import annotations

from ds_engine.runtime.fp16 import fused_optimizer, loss_scaler, unfused_optimizer

__all__ = ["fused_optimizer", "loss_scaler", "unfused_optimizer"]
