"""`deepspeed.runtime.zenflow.zenflow_config`: `ZenFlowConfig`, the `zero_optimization.zenflow` model (ds-zero's).

Needs the `zero` extra: without ds-zero, using it raises ImportError naming `pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ds_zero import ZenFlowConfig

__all__ = ["ZenFlowConfig"]


def __getattr__(name: str) -> Any:
    if name == "ZenFlowConfig":
        from ds_engine._optional import require

        return require(
            "ds_zero", extra="zero", feature=f"deepspeed.runtime.zenflow.zenflow_config.{name}"
        ).ZenFlowConfig
    raise AttributeError(f"module 'ds_engine.runtime.zenflow.zenflow_config' has no attribute {name!r}")
