"""`deepspeed.sequence.fpdt_layer`: ds-parallel's FPDT, the sequence in chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._fpdt import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.fpdt_layer",
    "ds_parallel.sequence._fpdt",
    extra="parallel",
    feature="ds_engine.sequence.fpdt_layer (deepspeed.sequence.fpdt_layer, FPDT, the sequence in chunks)",
)
