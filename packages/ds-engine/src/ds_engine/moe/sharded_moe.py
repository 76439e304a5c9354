"""`deepspeed.moe.sharded_moe`: ds-parallel's `ds_parallel.moe.sharded_moe` (DeepSpeed-MoE gating and dispatch).

Needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.moe.sharded_moe import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.sharded_moe",
    "ds_parallel.moe.sharded_moe",
    extra="parallel",
    feature="ds_engine.moe.sharded_moe (deepspeed.moe.sharded_moe, mixture of experts)",
)
