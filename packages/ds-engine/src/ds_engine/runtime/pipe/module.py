"""`deepspeed.runtime.pipe.module`: ds-pipe's API (`ds_pipe` keeps its module classes at the top level)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_pipe's own
    from ds_pipe import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.pipe.module",
    "ds_pipe",
    extra="pipe",
    feature="ds_engine.runtime.pipe.module (deepspeed.runtime.pipe.module, pipeline parallelism)",
)
