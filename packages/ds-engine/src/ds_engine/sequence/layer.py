"""`deepspeed.sequence.layer`: ds-parallel's `DistributedAttention` (DeepSpeed-Ulysses)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence.layer import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.layer",
    "ds_parallel.sequence.layer",
    extra="parallel",
    feature="ds_engine.sequence.layer (deepspeed.sequence.layer, Ulysses sequence parallelism)",
)
