"""`deepspeed.sequence.autosp_vit`: ds-parallel's AutoSP's ViT attention wrapper."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._autosp_vit import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.autosp_vit",
    "ds_parallel.sequence._autosp_vit",
    extra="parallel",
    feature="ds_engine.sequence.autosp_vit (deepspeed.sequence.autosp_vit, AutoSP's ViT attention wrapper)",
)
