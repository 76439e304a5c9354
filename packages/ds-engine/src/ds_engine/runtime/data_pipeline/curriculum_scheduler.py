"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: `CurriculumScheduler` (`_data.curriculum`)."""

from __future__ import annotations

from ds_engine._data.curriculum import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
