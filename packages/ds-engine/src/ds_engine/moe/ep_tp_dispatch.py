"""`deepspeed.moe.ep_tp_dispatch`: folded AutoEP+AutoTP dispatch (split routed assignments over TP lanes, restore).

ds-parallel's `ds_parallel.autoep`; needs the `parallel` extra. `dist` is ds-comm, which the dispatch issues its
collectives through (DeepSpeed's module names `deepspeed.comm` so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ds_comm as dist
from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    pass

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.moe.ep_tp_dispatch",
    "ds_parallel.autoep",
    extra="parallel",
    feature="ds_engine.moe.ep_tp_dispatch (deepspeed.moe.ep_tp_dispatch, AutoEP+AutoTP folding)",
    names=[
        "RestoreContext",
        "RoutedAssignmentPayload",
        "assert_tp_payload_consistent",
        "assignment_ordinals_by_expert",
        "dispatch_counters",
        "partition_assignments",
        "restore_combined",
    ],
)
__all__ += ["dist"]
