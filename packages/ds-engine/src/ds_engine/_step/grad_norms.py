"""Gradient-norm helpers users import from `deepspeed.runtime.utils`: `clip_grad_norm_`, `get_global_norm`...

`clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None)` follows DeepSpeed 0.19.8: the norm of this
rank's gradients (summed over the model-parallel group with an `mpu`, counting replicated parameters on
model-parallel rank 0 only; the max for `inf`), then *averaged* over the data-parallel group (DeepSpeed
does so because MoE expert gradients differ across ranks), and the gradients scaled in place by
`min(1, max_norm / (norm + 1e-6))`. It returns that norm as a tensor. A collective when
torch.distributed is initialized: every rank of the data-parallel group calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

import ds_comm

__all__ = ["clip_grad_norm_", "get_global_norm", "has_inf_or_nan", "is_model_parallel_parameter", "model_parallel_norm"]


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """Whether `p` is split across model-parallel ranks (Megatron's `model_parallel` / `tensor_model_parallel`)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether `x` holds an inf or NaN, as a boolean scalar tensor on `x`'s device (no host sync)."""
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return torch.isfinite(x.amax()).logical_and(torch.isfinite(x.amin())).logical_not()


def _invalid(norm: Any) -> bool:
    if isinstance(norm, torch.Tensor):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


def get_global_norm(norm_list: Iterable[float | torch.Tensor]) -> float:
    """The L2 norm of norms: `sqrt(sum(n ** 2))`; inf when one of them is inf, NaN or negative."""
    norms = list(norm_list)
    if any(_invalid(n) for n in norms):
        return float("inf")
    return math.sqrt(sum(float(n) ** 2 for n in norms))


def model_parallel_norm(
    tensors: list[torch.Tensor], norm_type: float, mpu: Any = None, owners: list[torch.Tensor] | None = None
) -> torch.Tensor:
    """The `norm_type` norm of `tensors` over the model-parallel group of `mpu` (this rank's alone without one).

    For a finite `norm_type`, a tensor whose owner (`owners[i]`, default the tensor) is not model-parallel is
    replicated on every model-parallel rank and counts on model-parallel rank 0 only. A 0-dim tensor on the
    first tensor's device (cpu when there is none).
    """
    owners = tensors if owners is None else owners
    norm_type = float(norm_type)
    device = tensors[0].device if tensors else torch.device("cpu")
    group = mpu.get_model_parallel_group() if mpu is not None else None
    if norm_type == math.inf:
        maxes = [t.detach().abs().max().float() for t in tensors if t.numel()]
        total = torch.stack(maxes).max() if maxes else torch.zeros((), device=device)
        if mpu is not None:
            ds_comm.all_reduce(total, op=ds_comm.ReduceOp.MAX, group=group)
        return total
    counted = [
        t
        for t, owner in zip(tensors, owners, strict=True)
        if mpu is None or mpu.get_model_parallel_rank() == 0 or is_model_parallel_parameter(owner)
    ]
    terms = [t.detach().float().norm(norm_type) for t in counted]
    total = torch.stack(terms).pow(norm_type).sum() if terms else torch.zeros((), device=device)
    if mpu is not None:
        ds_comm.all_reduce(total, op=ds_comm.ReduceOp.SUM, group=group)
    return total.pow(1.0 / norm_type)


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2, mpu: Any = None
) -> torch.Tensor:
    """Clip the gradients of `parameters` in place to `max_norm` (see the module docstring); returns the norm."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    total = model_parallel_norm([p.grad for p in params], norm_type, mpu, owners=params)
    if ds_comm.is_initialized():
        dp_group = mpu.get_data_parallel_group() if mpu is not None else None
        total = total / ds_comm.get_world_size(dp_group)
        ds_comm.all_reduce(total, group=dp_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.device))
    return total
