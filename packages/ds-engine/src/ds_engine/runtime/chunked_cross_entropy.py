"""`deepspeed.runtime.chunked_cross_entropy`: ds-parallel's chunked cross entropy over given logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._chunked_cross_entropy import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.runtime.chunked_cross_entropy",
    "ds_parallel.sequence._chunked_cross_entropy",
    extra="parallel",
    feature="ds_engine.runtime.chunked_cross_entropy (chunked cross entropy over given logits)",
)
