"""`deepspeed.module_inject.auto_ep`: AutoEP's driver: detect a model's MoE blocks, then replace them.

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.auto_ep",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.module_inject.auto_ep (deepspeed.module_inject.auto_ep, AutoEP)",
    names=["AutoEP"],
    renames={"_resolve_route_scale": "resolve_route_scale"},
)
