"""`deepspeed.accelerator` for migrated scripts: `get_accelerator()` from ds-comm."""

from __future__ import annotations

from ds_comm import Accelerator, get_accelerator, is_current_accelerator_supported, set_accelerator

__all__ = ["Accelerator", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
