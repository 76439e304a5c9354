"""ds-zero: ZeRO stages 1-3 with CPU offload, usable with any torch optimizer and no engine."""

from __future__ import annotations

from ds_zero.__about__ import __version__
from ds_zero.config import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = ["OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig", "__version__"]
