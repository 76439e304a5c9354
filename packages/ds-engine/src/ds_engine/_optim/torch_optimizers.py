"""Lion and LAMB in plain torch, for the `lion` and `lamb` config names when no ds-ops kernel applies.

DeepSpeed maps these names to its fused CUDA kernels (FusedLion, FusedLamb); here they are small
torch implementations with the same hyper-parameters and defaults, so a config runs on any device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

logger = logging.getLogger(__name__)

__all__ = ["FusedLion", "Lamb", "Lion"]

Params = Iterable[torch.Tensor] | Iterable[dict[str, Any]]


class Lion(Optimizer):
    """Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step, for each parameter `p` with gradient `g` and momentum `m`:
    `p *= 1 - lr * weight_decay`, `p -= lr * sign(beta1 * m + (1 - beta1) * g)`,
    `m = beta2 * m + (1 - beta2) * g`. Weight decay is decoupled, as in AdamW.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (default 1e-4; Lion wants 3-10x smaller lr than AdamW).
        betas: (beta1, beta2), the interpolation for the update direction and the momentum decay.
        weight_decay: decoupled weight decay.
    """

    def __init__(
        self, params: Params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        if lr < 0:
            raise ValueError(f"Lion: lr must be >= 0, got {lr}")
        for i, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Lion: betas[{i}] must be in [0, 1), got {beta}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            momenta = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
            beta1, beta2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            if wd != 0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            direction = torch._foreach_mul(momenta, beta1)
            torch._foreach_add_(direction, grads, alpha=1.0 - beta1)
            torch._foreach_sign_(direction)
            torch._foreach_add_(params, direction, alpha=-lr)
            torch._foreach_mul_(momenta, beta2)
            torch._foreach_add_(momenta, grads, alpha=1.0 - beta2)
        return loss


class FusedLion(Lion):
    """DeepSpeed's `FusedLion` signature and defaults over `Lion`: what the `lion` config name builds.

    DeepSpeed's defaults are `lr=1e-3, betas=(0.9, 0.999)` (its CPU Lion's too), not the paper's
    `1e-4, (0.9, 0.99)` that `Lion` keeps; a config that leaves them out must step the same in ds as in
    DeepSpeed, with or without optimizer offload. `set_grad_none` is accepted for the signature: `zero_grad`
    already sets gradients to None (torch's default).
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = set_grad_none


class Lamb(Optimizer):
    """LAMB (You et al., 2019): Adam moments with a per-parameter trust ratio.

    Matches DeepSpeed's FusedLamb: `update = m_hat / (sqrt(v_hat) + eps) + weight_decay * p`
    (`sqrt(v_hat + eps)` with `eps_inside_sqrt`), trust ratio `||p|| / ||update||` clamped to
    `[min_coeff, max_coeff]` (1 when either norm is 0), then `p -= lr * trust * update`.

    Args:
        params: parameters or parameter groups.
        lr: learning rate.
        bias_correction: divide the moments by `1 - beta ** step`.
        betas: Adam's moment decays.
        eps: denominator term.
        eps_inside_sqrt: put `eps` under the square root.
        weight_decay: L2 term added to the update (inside the trust ratio).
        max_coeff: upper clamp of the trust ratio.
        min_coeff: lower clamp of the trust ratio.
        amsgrad: not supported (FusedLamb refuses it too).
    """

    def __init__(
        self,
        params: Params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("Lamb: amsgrad=True is not supported (DeepSpeed's FusedLamb refuses it too)")
        if min_coeff > max_coeff:
            raise ValueError(f"Lamb: min_coeff={min_coeff} must not exceed max_coeff={max_coeff}")
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": tuple(betas),
            "eps": eps,
            "eps_inside_sqrt": eps_inside_sqrt,
            "weight_decay": weight_decay,
            "max_coeff": max_coeff,
            "min_coeff": min_coeff,
        }
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                self._update(p, group, beta1, beta2)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any], beta1: float, beta2: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        state["step"] += 1
        grad = p.grad.float()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
        m_hat, v_hat = exp_avg, exp_avg_sq
        if group["bias_correction"]:
            m_hat = exp_avg / (1.0 - beta1 ** state["step"])
            v_hat = exp_avg_sq / (1.0 - beta2 ** state["step"])
        denom = (v_hat + group["eps"]).sqrt() if group["eps_inside_sqrt"] else v_hat.sqrt().add_(group["eps"])
        weight = p.float()
        update = m_hat / denom
        if group["weight_decay"] != 0:
            update.add_(weight, alpha=group["weight_decay"])
        w_norm = torch.linalg.vector_norm(weight)
        u_norm = torch.linalg.vector_norm(update)
        trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
        trust = trust.clamp(group["min_coeff"], group["max_coeff"])
        p.add_((update * trust).to(p.dtype), alpha=-group["lr"])
