"""ds-ops: Compiled ops: op builders (JIT with ninja, AOT), CPU/CUDA optimizers, precision helpers, ds_report."""

from __future__ import annotations

from ds_ops.__about__ import __version__

__all__ = ["__version__"]
