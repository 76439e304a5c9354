"""`deepspeed.runtime.zero.config`: `DeepSpeedZeroConfig`, the `zero_optimization` model (ds-zero's `ZeroConfig`).

Needs the `zero` extra: without ds-zero, using a name here raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_zero import ZeroConfig as DeepSpeedZeroConfig

__all__ = ["DeepSpeedZeroConfig"]

#: DeepSpeed's name -> ds-zero's
_NAMES = {"DeepSpeedZeroConfig": "ZeroConfig"}


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        from ds_engine._optional import require

        ds_zero = require("ds_zero", extra="zero", feature=f"deepspeed.runtime.zero.config.{name}")
        return getattr(ds_zero, _NAMES[name])
    raise AttributeError(f"module 'ds_engine.runtime.zero.config' has no attribute {name!r}")
