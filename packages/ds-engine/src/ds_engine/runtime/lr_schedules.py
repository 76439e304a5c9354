"""`deepspeed.runtime.lr_schedules`: the same objects as `ds_engine.lr_schedules` (WarmupLR, OneCycle, ...)."""

from __future__ import annotations

from ds_engine._optim import lr_schedules as _impl
from ds_engine._optim.lr_schedules import *  # noqa: F403 - this module is a re-export by design

__all__ = list(_impl.__all__)
