"""`as_zero_config`: the `ZeroConfig` that `Init`, `DeepSpeedZeRoOffload` and the stage-3 optimizer accept.

Each takes a `ds_zero.ZeroConfig`, a `zero_optimization` dict or None; they share this one reading so a
dict is validated (with `zero_optimization` in the error's key path) the same way everywhere. It sits
below the stage packages because construction (`_construct`), scheduling (`_schedule`) and the optimizer
(`_stage3`) all call it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ds_comm

if TYPE_CHECKING:
    from ds_zero.config import ZeroConfig

__all__ = ["as_zero_config"]


def as_zero_config(config: ZeroConfig | Mapping[str, Any] | None, *, stage: int = 3) -> ZeroConfig:
    """A `ZeroConfig` from a model, a `zero_optimization` dict, or None (defaults at `stage`)."""
    from ds_zero.config import ZeroConfig  # pydantic: loaded on first use, not at import

    if config is None:
        return ZeroConfig(stage=stage)
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, Mapping):
        data = dict(config)
        data.setdefault("stage", stage)
        return ds_comm.validate_section(ZeroConfig, data, path="zero_optimization")
    raise TypeError(f"config must be a ds_zero.ZeroConfig or a zero_optimization dict, got {type(config).__name__}")
