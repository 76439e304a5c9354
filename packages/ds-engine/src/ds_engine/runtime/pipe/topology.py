"""`deepspeed.runtime.pipe.topology`: ds-pipe's API (`ds_pipe` keeps its topology classes at the top level)."""

from __future__ import annotations

from ds_engine._reexport import optional_reexport

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe.topology",
    "ds_pipe",
    extra="pipe",
    feature="ds_engine.runtime.pipe.topology (deepspeed.runtime.pipe.topology, pipeline parallelism)",
)
