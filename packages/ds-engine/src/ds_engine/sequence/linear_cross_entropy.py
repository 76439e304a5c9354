"""`deepspeed.sequence.linear_cross_entropy`: ds-parallel's fused LM-head projection and cross entropy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._linear_cross_entropy import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.linear_cross_entropy",
    "ds_parallel.sequence._linear_cross_entropy",
    extra="parallel",
    feature="ds_engine.sequence.linear_cross_entropy (fused LM-head projection and cross entropy)",
)
