"""ds-zero: ZeRO stages 1-3 with CPU offload, usable with any torch optimizer and no engine."""

from __future__ import annotations

from ds_zero.__about__ import __version__

__all__ = ["__version__"]
