"""Overflow detection that agrees across ranks: one local fused check, one all-reduce."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

import ds_comm


def local_overflow(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A 1-element float tensor: 1.0 when any tensor holds an inf or nan, else 0.0 (no host sync)."""
    found = None
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        # min and max are finite exactly when every element is (both propagate nan), and one read-only
        # reduction is an order of magnitude faster on CPU than materialising `isfinite(t)`.
        lo, hi = torch.aminmax(t)
        bad = torch.logical_not(torch.isfinite(torch.stack((lo, hi))).all())
        found = bad if found is None else torch.logical_or(found, bad)
    if found is None:
        return torch.zeros(1)
    return found.reshape(1).float()


def has_overflow(tensors: Iterable[torch.Tensor | None], group: ProcessGroup | None = None) -> bool:
    """Whether any rank in `group` has an inf/nan in its `tensors`.

    Every rank must call it (it issues one MAX all-reduce of a 1-element tensor on `group` when
    distributed), so all ranks skip or take the step together.
    """
    flag = local_overflow(tensors)
    if ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1:
        ds_comm.all_reduce(flag, op=ds_comm.ReduceOp.MAX, group=group)
    return bool(flag.item())


def unscale_and_check_(tensors: list[torch.Tensor], inv_scale: float) -> torch.Tensor:
    """Multiply `tensors` in place by `inv_scale` and return the local overflow flag (1-element float).

    One fused pass per device with torch's AMP kernel (`_amp_foreach_non_finite_check_and_unscale_`);
    with `inv_scale == 1` only the check runs (nothing is written). No host sync.
    """
    tensors = [t for t in tensors if t is not None and t.numel() > 0]
    if inv_scale == 1.0:
        return local_overflow(tensors)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    if not by_device:
        return torch.zeros(1)
    flags = []
    for device, group in by_device.items():
        found = torch.zeros(1, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, torch.full((1,), inv_scale, device=device))
        flags.append(found)
    first = flags[0]
    for other in flags[1:]:
        first = torch.maximum(first, other.to(first.device))
    return first
