"""`deepspeed.module_inject.auto_ep_layer`: ds-parallel's `ds_parallel.autoep` (AutoEP's layer, router, experts and
the conversion). Needs the `parallel` extra. `dist` is ds-comm, which the layer's exchanges go through."""

from __future__ import annotations

from typing import TYPE_CHECKING

import ds_comm as dist
from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.autoep import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.auto_ep_layer",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.module_inject.auto_ep_layer (deepspeed.module_inject.auto_ep_layer, AutoEP)",
)
__all__ += ["dist"]
