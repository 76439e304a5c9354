"""`deepspeed.runtime.fp16.loss_scaler`: ds-ops' static and dynamic loss scalers.

`LossScaler(scale)` keeps one scale; `DynamicLossScaler` halves it on overflow (after `hysteresis`
overflows) and doubles it after `scale_window` clean steps, as DeepSpeed's does.
"""

from __future__ import annotations

from ds_ops.precision import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
