"""`deepspeed.runtime.zero.offload_config`: the offload enums and section models under DeepSpeed's path.

`OffloadDeviceEnum` / `OffloadStateTypeEnum` are ds-ops' (what `engine.offload_states()` takes);
`DeepSpeedZeroOffloadParamConfig` / `DeepSpeedZeroOffloadOptimizerConfig` are ds-zero's section models,
looked up on ds-zero (the `zero` extra) on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

from ds_engine._optional import require
from ds_ops import OffloadDeviceEnum, OffloadStateTypeEnum

#: DeepSpeed's name -> ds-zero's section model.
_ZERO_MODELS = {
    "DeepSpeedZeroOffloadOptimizerConfig": "OffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig": "OffloadParamConfig",
}

__all__ = [*sorted(_ZERO_MODELS), "OffloadDeviceEnum", "OffloadStateTypeEnum"]


def __getattr__(name: str) -> Any:
    if name in _ZERO_MODELS:
        require("ds_zero", extra="zero", feature=f"deepspeed.runtime.zero.offload_config.{name}")
        return getattr(importlib.import_module("ds_zero.config"), _ZERO_MODELS[name])
    raise AttributeError(f"module 'ds_engine.runtime.zero.offload_config' has no attribute {name!r}")
