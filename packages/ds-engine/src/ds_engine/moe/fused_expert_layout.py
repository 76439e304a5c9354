"""`deepspeed.moe.fused_expert_layout`: the orientation of fused gate+up expert tensors from their shapes.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.fused_expert_layout",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.moe.fused_expert_layout (deepspeed.moe.fused_expert_layout, AutoEP)",
    names=["FusedExpertLayout", "classify_fused_gate_up_layout"],
)
