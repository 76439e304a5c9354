"""ds-engine: The config-driven training engine: initialize(), DeepSpeedEngine, precision, checkpoints."""

from __future__ import annotations

from ds_engine.__about__ import __version__

__all__ = ["__version__"]
