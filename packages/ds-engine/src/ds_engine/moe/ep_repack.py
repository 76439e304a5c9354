"""`deepspeed.moe.ep_repack`: this rank's experts of a source MoE block, in AutoEP's layout.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.ep_repack",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.moe.ep_repack (deepspeed.moe.ep_repack, AutoEP)",
    names=["repack_expert_weights"],
)
