"""`deepspeed.runtime.zero.offload_config`: the offload enums and section models under DeepSpeed's path.

`OffloadDeviceEnum` / `OffloadStateTypeEnum` are ds-ops' (what `engine.offload_states()` takes);
`DeepSpeedZeroOffloadParamConfig` / `DeepSpeedZeroOffloadOptimizerConfig` are ds-zero's section models.
"""

from __future__ import annotations

from ds_ops import OffloadDeviceEnum, OffloadStateTypeEnum
from ds_zero.config import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
from ds_zero.config import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig

__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
