"""`deepspeed.runtime.pipe.module`: ds-pipe's API (`ds_pipe` keeps its module classes at the top level)."""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe.module", "ds_pipe", extra="pipe",
    feature="ds_engine.runtime.pipe.module (deepspeed.runtime.pipe.module, pipeline parallelism)")
