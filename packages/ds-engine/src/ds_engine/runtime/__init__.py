"""`deepspeed.runtime` for migrated scripts: `ds_engine.runtime.lr_schedules`, DeepSpeed's path of the schedules."""

from __future__ import annotations

from ds_engine.runtime import lr_schedules

__all__ = ["lr_schedules"]
