"""`deepspeed.moe.mappings`: ds-parallel's `ds_parallel.moe.mappings` (MoE tokens split over tensor-parallel ranks).

Needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.moe.mappings import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.mappings",
    "ds_parallel.moe.mappings",
    extra="parallel",
    feature="ds_engine.moe.mappings (deepspeed.moe.mappings, MoE token drop/gather)",
)
