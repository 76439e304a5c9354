"""One AdamW update of a parameter slice, in torch, with the moments passed in rather than owned.

ZenFlow's selective optimizers update a *copy* of a parameter's selected columns (advanced indexing
copies), with moments that belong to the selection and may live on the host between steps, so
`torch.optim.AdamW` (which owns `p`'s state and updates `p` itself) cannot do it. The arithmetic is
`torch.optim.AdamW`'s single-tensor form, in its order, so a slice stepped here agrees with AdamW run on
that slice alone to fp32 rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AdamWHyper", "adamw_update_"]


@dataclass(frozen=True)
class AdamWHyper:
    """A param group's AdamW settings, read once per group step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> AdamWHyper:
        beta1, beta2 = group["betas"]
        return cls(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group.get("maximize", False)),
        )


@torch.no_grad()
def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamWHyper,
    max_exp_avg_sq: torch.Tensor | None = None,
) -> None:
    """Advance `step` by one and apply one AdamW update to `param`, `exp_avg`, `exp_avg_sq` in place.

    Args:
        param: the values to update (a slice copy or a view; updated in place).
        grad: its gradient, same shape.
        exp_avg, exp_avg_sq: first and second moments, same number of elements (viewed as `param`).
        step: a 0-dim float tensor, the number of updates made so far; incremented here.
        hyper: the group's settings.
        max_exp_avg_sq: the running maximum of `exp_avg_sq` (required when `hyper.amsgrad`).
    """
    if hyper.maximize:
        grad = -grad
    step += 1
    t = float(step.item())
    if hyper.weight_decay != 0.0:
        param.mul_(1.0 - hyper.lr * hyper.weight_decay)
    exp_avg.lerp_(grad, 1.0 - hyper.beta1)
    exp_avg_sq.mul_(hyper.beta2).addcmul_(grad, grad, value=1.0 - hyper.beta2)
    bias_correction1 = 1.0 - hyper.beta1**t
    bias_correction2_sqrt = math.sqrt(1.0 - hyper.beta2**t)
    if hyper.amsgrad:
        if max_exp_avg_sq is None:
            raise ValueError("amsgrad needs max_exp_avg_sq")
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    else:
        second = exp_avg_sq
    denom = (second.sqrt() / bias_correction2_sqrt).add_(hyper.eps)
    param.addcdiv_(exp_avg, denom, value=-hyper.lr / bias_correction1)
