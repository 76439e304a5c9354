"""`deepspeed.runtime.pipe.schedule`: ds-pipe's schedules and instructions (`TrainSchedule`, `ForwardPass`, ...)."""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe.schedule",
    "ds_pipe.schedule",
    extra="pipe",
    feature="ds_engine.runtime.pipe.schedule (deepspeed.runtime.pipe.schedule, pipeline parallelism)",
)
