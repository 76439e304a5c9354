"""`deepspeed.runtime.engine`: the module path of `DeepSpeedEngine` (type checks in the frameworks use it)."""

from __future__ import annotations

from ds_engine._engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
