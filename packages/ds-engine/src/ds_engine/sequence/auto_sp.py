"""`deepspeed.sequence.auto_sp`: ds-parallel's AutoSP, one-call sequence parallelism for multimodal models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._auto_sp import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.auto_sp",
    "ds_parallel.sequence._auto_sp",
    extra="parallel",
    feature="ds_engine.sequence.auto_sp (deepspeed.sequence.auto_sp, AutoSP for multimodal models)",
)
