"""`deepspeed.runtime.data_pipeline.curriculum_scheduler`: `CurriculumScheduler` (`_data_efficiency.curriculum`)."""

from __future__ import annotations

from ds_engine._data_efficiency.curriculum import CurriculumScheduler

__all__ = ["CurriculumScheduler"]
