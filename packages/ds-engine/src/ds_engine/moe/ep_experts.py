"""`deepspeed.moe.ep_experts`: AutoEP's grouped experts and their activations.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.ep_experts",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.moe.ep_experts (deepspeed.moe.ep_experts, AutoEP)",
    names=["EXPERT_ACTIVATIONS"],
    renames={"GroupedExperts": "SizedGroupedExperts"},
)
