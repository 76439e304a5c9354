"""`deepspeed.utils` for migrated scripts: `logger`, `log_dist`, and `utils.zero_to_fp32` (from ds-zero).

`logger` is the `ds` logger the ds packages share (the library adds no handlers); `log_dist(message,
ranks=(0,), level=logging.INFO)` logs on the listed ranks only (ds-comm's). `ds_engine.utils.zero_to_fp32`
(DeepSpeed's checkpoint consolidation) needs the `zero` extra and `ds_engine.utils.groups` (ds-parallel's
mesh views) the `parallel` extra; both are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

# Binds `ds_engine.utils.logging` to the submodule (DeepSpeed's `deepspeed.utils.logging`), not the stdlib's.
from ds_engine.utils.init_on_device import OnDevice
from ds_engine.utils.logging import log_dist, logger

if TYPE_CHECKING:  # type checkers see the lazy submodule
    from ds_engine.utils import groups as groups
    from ds_engine.utils import zero_to_fp32 as zero_to_fp32

__all__ = ["OnDevice", "log_dist", "logger"]


def __getattr__(name: str) -> ModuleType:
    if name in ("zero_to_fp32", "groups"):
        return importlib.import_module(f"ds_engine.utils.{name}")
    raise AttributeError(f"module 'ds_engine.utils' has no attribute {name!r}")
