"""ds-launcher: The `deepspeed` launcher: hostfiles, resource filters, local and multi-node runners."""

from __future__ import annotations

from ds_launcher.__about__ import __version__

__all__ = ["__version__"]
