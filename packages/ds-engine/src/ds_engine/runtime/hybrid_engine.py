"""`deepspeed.runtime.hybrid_engine`: the module path of `DeepSpeedHybridEngine`."""

from __future__ import annotations

from ds_engine._hybrid.engine import DeepSpeedHybridEngine

__all__ = ["DeepSpeedHybridEngine"]
