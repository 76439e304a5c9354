"""`deepspeed.moe.ep_count`: routed tokens per expert, without a device sync.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.ep_count",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.moe.ep_count (deepspeed.moe.ep_count, AutoEP)",
    names=["count_tokens_per_expert"],
)
