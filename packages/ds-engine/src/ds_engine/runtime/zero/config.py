"""`deepspeed.runtime.zero.config`: `DeepSpeedZeroConfig`, the `zero_optimization` model (ds-zero's `ZeroConfig`).

Also the offload section models DeepSpeed's module re-exports (`DeepSpeedZeroOffloadParamConfig`,
`DeepSpeedZeroOffloadOptimizerConfig`, ds-zero's) and `ZeroStageEnum`, the stage numbers by name
(an `int` enum: `ZeroConfig(stage=ZeroStageEnum.gradients).stage == 2`).

Needs the `zero` extra: without ds-zero, using a model here raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

import enum
import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_zero import ZeroConfig as DeepSpeedZeroConfig
    from ds_zero.config import OffloadOptimizerConfig as DeepSpeedZeroOffloadOptimizerConfig
    from ds_zero.config import OffloadParamConfig as DeepSpeedZeroOffloadParamConfig

__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "ZeroStageEnum",
]


class ZeroStageEnum(int, enum.Enum):
    """ZeRO stages by what they partition."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3  # an alias of `weights` (Enum aliases share the member)


#: DeepSpeed's name -> (ds-zero module, ds-zero's name)
_NAMES = {
    "DeepSpeedZeroConfig": ("ds_zero", "ZeroConfig"),
    "DeepSpeedZeroOffloadOptimizerConfig": ("ds_zero.config", "OffloadOptimizerConfig"),
    "DeepSpeedZeroOffloadParamConfig": ("ds_zero.config", "OffloadParamConfig"),
}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        from ds_engine._optional import require

        require("ds_zero", extra="zero", feature=f"deepspeed.runtime.zero.config.{name}")
        module, attr = _NAMES[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ds_engine.runtime.zero.config' has no attribute {name!r}")
