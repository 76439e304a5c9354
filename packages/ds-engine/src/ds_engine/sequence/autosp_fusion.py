"""`deepspeed.sequence.autosp_fusion`: ds-parallel's AutoSP's vision-language fusion adapters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._autosp_fusion import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.autosp_fusion",
    "ds_parallel.sequence._autosp_fusion",
    extra="parallel",
    feature="ds_engine.sequence.autosp_fusion (AutoSP's vision-language fusion adapters)",
)
