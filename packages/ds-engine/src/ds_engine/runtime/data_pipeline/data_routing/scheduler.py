"""`deepspeed.runtime.data_pipeline.data_routing.scheduler`: `RandomLTDScheduler` (and its `BaseScheduler`)."""

from __future__ import annotations

from ds_engine._data.ltd_scheduler import BaseScheduler, RandomLTDScheduler

__all__ = ["BaseScheduler", "RandomLTDScheduler"]
