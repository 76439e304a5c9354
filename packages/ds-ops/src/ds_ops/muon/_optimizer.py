"""`MuonWithAuxAdam`: Muon for the hidden weight matrices, Adam for everything else, as one optimizer.

Why one optimizer with two kinds of groups: Muon is only defined for matrices, and the embedding,
the output head, biases and norms still need an elementwise method; DeepSpeed's `"type": "Muon"`
builds exactly this split (groups flagged `use_muon`), so checkpoints and lr schedules see one
optimizer.

Under ZeRO stages 1 and 2 a Muon group holds a flat partition (1-D) instead of matrices, and
Newton–Schulz needs each whole matrix: the ZeRO optimizer gathers the full gradients and
momentum, computes the Muon update with `muon_update`, and leaves this rank's slice of it in the
partition's `.grad` (and the advanced momentum in `state["momentum_buffer"]`). It marks such a
partition with `muon_update_in_grad = True`, and only a marked 1-D parameter is stepped with its
`.grad` taken as the finished update (DeepSpeed takes any 1-D one so; an unmarked one here is an
error rather than a silent SGD step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ds_ops.muon._newton_schulz import NS_METHODS, muon_update

__all__ = ["MUON_DEFAULTS", "AUX_ADAM_DEFAULTS", "MuonWithAuxAdam"]

MUON_DEFAULTS: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "ns_steps": 5}
"""Settings a `use_muon=True` group gets unless it sets them (DeepSpeed 0.19.8's, plus `ns_steps`)."""
AUX_ADAM_DEFAULTS: dict[str, Any] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
"""Settings a `use_muon=False` group gets unless it sets them."""


class MuonWithAuxAdam(Optimizer):
    """Muon on groups with `use_muon=True`, Adam(W) on groups with `use_muon=False`.

    Muon group step, per parameter: `p *= 1 - lr * weight_decay`, then `p -= lr * muon_update(...)`
    with the parameter's `momentum_buffer` (per attention head when the parameter carries
    `muon_num_heads`, DeepSpeed's per-head Muon tag). Adam group step: bias-corrected Adam moments,
    `p -= lr * m_hat / (sqrt(v_hat) + eps)`, with decoupled weight decay (`adam_w_mode=True`,
    AdamW) or L2 decay added to the gradient (`adam_w_mode=False`).

    Args:
        param_groups: dicts with `params` and `use_muon`; other keys override the defaults
            (`MUON_DEFAULTS`, `AUX_ADAM_DEFAULTS`).
        adam_w_mode: decoupled weight decay in the Adam groups.

    Raises:
        ValueError: a group without `use_muon`, an unknown `ns_method`, a bad hyper-parameter, or a
            Muon group holding a parameter with fewer than 2 dims.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]], adam_w_mode: bool = True) -> None:
        groups = []
        for i, group in enumerate(param_groups):
            if not isinstance(group, dict) or "use_muon" not in group:
                raise ValueError(
                    f"MuonWithAuxAdam: param group {i} has no 'use_muon' flag; pass dicts "
                    "{'params': [...], 'use_muon': True/False} (Muon for hidden matrices, Adam for the rest)"
                )
            defaults = MUON_DEFAULTS if group["use_muon"] else AUX_ADAM_DEFAULTS
            group = {**defaults, **group, "use_muon": bool(group["use_muon"])}
            _check_group(i, group)
            if group["use_muon"]:
                # Largest matrices first, as DeepSpeed orders them (its work split across ranks).
                group["params"] = sorted(list(group["params"]), key=lambda p: tuple(p.size()), reverse=True)
            groups.append(group)
        self.adam_w_mode = bool(adam_w_mode)
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_group(group)
            else:
                self._adam_group(group)
        return loss

    def _muon_group(self, group: dict[str, Any]) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.ndim < 2:
                if not getattr(p, "muon_update_in_grad", False):
                    raise RuntimeError(
                        f"MuonWithAuxAdam: a {p.ndim}-D parameter in a use_muon group that no ZeRO optimizer "
                        "prepared (muon_update_in_grad is not set); Muon steps matrices only"
                    )
                update = p.grad  # a ZeRO partition: the gathered Muon update is already here (module docstring)
            else:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                update = muon_update(
                    p.grad,
                    state["momentum_buffer"],
                    beta=group["momentum"],
                    ns_steps=group["ns_steps"],
                    num_heads=getattr(p, "muon_num_heads", None),
                )
            if wd != 0:
                p.mul_(1.0 - lr * wd)
            p.add_(update.reshape(p.shape).to(p.dtype), alpha=-lr)

    def _adam_group(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad
            if wd != 0 and not self.adam_w_mode:
                grad = grad.add(p, alpha=wd)
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.lerp_(grad, 1.0 - beta1)
            exp_avg_sq.lerp_(grad.square(), 1.0 - beta2)
            m_hat = exp_avg / (1.0 - beta1 ** state["step"])
            v_hat = exp_avg_sq / (1.0 - beta2 ** state["step"])
            if wd != 0 and self.adam_w_mode:
                p.mul_(1.0 - lr * wd)
            p.add_(m_hat / (v_hat.sqrt() + eps), alpha=-lr)


def _check_group(index: int, group: dict[str, Any]) -> None:
    where = f"MuonWithAuxAdam param group {index}"
    if group["lr"] < 0:
        raise ValueError(f"{where}: lr must be >= 0, got {group['lr']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got {group['weight_decay']}")
    if group["use_muon"]:
        if not 0.0 <= group["momentum"] < 1.0:
            raise ValueError(f"{where}: momentum must be in [0, 1), got {group['momentum']}")
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"{where}: ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
        if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
            raise ValueError(f"{where}: ns_steps must be a positive integer, got {group['ns_steps']!r}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        flat = [tuple(p.shape) for p in params if p.ndim < 2]
        if flat:
            raise ValueError(
                f"{where}: Muon needs matrices (>= 2-D), got parameters of shapes {flat}; put them in a "
                "use_muon=False group"
            )
        group["params"] = params
    else:
        beta1, beta2 = group["betas"]
        for k, beta in enumerate((beta1, beta2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"{where}: betas[{k}] must be in [0, 1), got {beta}")
        if group["eps"] < 0:
            raise ValueError(f"{where}: eps must be >= 0, got {group['eps']}")
