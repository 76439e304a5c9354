"""What the collectives look up per process group on every call (is it waited on the CPU?), cached safely.

[Note: why not id(group)] A dict keyed by `id(group)` outlives the group: once a destroyed group
is garbage collected, a new group can be allocated at the same address and would be served the
old group's answer (a gloo group's CPU wait for an nccl group, or the reverse). The cache holds
the groups weakly, so an entry dies with its group, and `forget` drops entries when ds_comm
destroys groups.
"""

from __future__ import annotations

import weakref

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["forget", "waits_on_cpu"]

_waits_on_cpu: weakref.WeakKeyDictionary[ProcessGroup, bool] = weakref.WeakKeyDictionary()


def waits_on_cpu(group: ProcessGroup | None) -> bool:
    """Whether ops on `group` (None: the default group) are waited on the CPU with a timeout: gloo's are."""
    key = group if group is not None else dist.group.WORLD
    if key is None:  # not initialised: let torch raise its usual error
        return dist.get_backend(group) == "gloo"
    cached = _waits_on_cpu.get(key)
    if cached is None:
        cached = dist.get_backend(key) == "gloo"
        _waits_on_cpu[key] = cached
    return cached


def forget(group: ProcessGroup | None = None) -> None:
    """Drop what is cached for `group`, or for every group when None (the groups are being destroyed)."""
    if group is None:
        _waits_on_cpu.clear()
    else:
        _waits_on_cpu.pop(group, None)
