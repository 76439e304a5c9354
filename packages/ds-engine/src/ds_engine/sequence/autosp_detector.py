"""`deepspeed.sequence.autosp_detector`: ds-parallel's AutoSP's module detection."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._autosp_detect import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.autosp_detector",
    "ds_parallel.sequence._autosp_detect",
    extra="parallel",
    feature="ds_engine.sequence.autosp_detector (deepspeed.sequence.autosp_detector, AutoSP's module detection)",
)
