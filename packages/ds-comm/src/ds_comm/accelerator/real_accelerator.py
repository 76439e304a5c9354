"""`deepspeed.accelerator.real_accelerator`: choosing the process's accelerator, by DeepSpeed's module name."""

from __future__ import annotations

from ds_comm.accelerator import (
    SUPPORTED_ACCELERATOR_LIST,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["SUPPORTED_ACCELERATOR_LIST", "get_accelerator", "is_current_accelerator_supported", "set_accelerator"]
