"""Global gradient norm over tensors that may be partitioned across ranks, and clipping by it."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed import ProcessGroup

import ds_comm


def local_norm_term(tensors: Iterable[torch.Tensor | None], norm_type: float = 2.0) -> torch.Tensor:
    """This rank's share of the `norm_type` norm, as a 1-element fp32 tensor on the tensors' device.

    The sum of |g|^p over `tensors` (the max |g| for p = inf), so partial terms of disjoint parts add
    (or max) up to the whole; no communication and no host sync.
    """
    grads = [t for t in tensors if t is not None and t.numel() > 0]
    p = float(norm_type)
    if not grads:
        return torch.zeros(1)
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads], p)
    stacked = torch.stack([n.float() for n in norms])
    return (stacked.max() if math.isinf(p) else stacked.pow(p).sum()).reshape(1)


def global_grad_norm(
    tensors: Iterable[torch.Tensor | None],
    *,
    norm_type: float = 2.0,
    group: ProcessGroup | None = None,
    partitioned: bool = True,
    comm_device: torch.device | None = None,
) -> torch.Tensor:
    """The `norm_type` norm of all `tensors` on all ranks of `group`, as a 0-dim fp32 tensor.

    [Note: where the norm lives] A caller says how its gradient is laid out, and this is the one place
    that turns the layout into communication: `partitioned` (ZeRO: each rank holds a disjoint part)
    means the partial terms are combined with one all-reduce over `group`; otherwise every rank holds
    the same full gradient and nothing is sent. The partial travels on `comm_device` when given (nccl
    needs the accelerator even when ZeRO-Offload keeps the partitions in host memory).

    Args:
        tensors: this rank's gradient tensors (None entries are skipped).
        norm_type: p of the p-norm; `inf` for the max-abs norm.
        group: the ranks whose tensors together make up the whole gradient.
        partitioned: True when each rank holds a disjoint part, False when each holds all of it.
        comm_device: where the partial is all-reduced (default: where the tensors are).

    Returns:
        The norm (on `comm_device` when given); inf or nan when a gradient has overflowed (the caller
        decides what to skip).
    """
    p = float(norm_type)
    local = local_norm_term(tensors, p)
    if comm_device is not None:
        local = local.to(comm_device)
    if partitioned and ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1:
        op = ds_comm.ReduceOp.MAX if math.isinf(p) else ds_comm.ReduceOp.SUM
        ds_comm.all_reduce(local, op=op, group=group)
    total = local if math.isinf(p) else local.pow(1.0 / p)
    return total.reshape(())


def clip_grads_by_norm_(
    tensors: Iterable[torch.Tensor | None], max_norm: float, total_norm: torch.Tensor, eps: float = 1e-6
) -> float:
    """Scale `tensors` in place so their global norm is at most `max_norm`; returns the factor used.

    Does nothing (factor 1.0) when `total_norm` is already within bounds or not finite (an overflowed
    step is skipped elsewhere, and scaling by nan would poison the gradients).
    """
    norm = float(total_norm)
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    factor = max_norm / (norm + eps)
    if factor >= 1.0:
        return 1.0
    grads = [t for t in tensors if t is not None]
    if grads:
        torch._foreach_mul_(grads, factor)
    return factor
