"""Shared cases for the CPU optimizer tests: parameter groups of every size, seeded gradients, lockstep runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

SIZES = (0, 1, 7, 4097, 1_000_003)
STEPS = 200

# Several param groups with different hyper-parameters; every size appears; weight decay on and off.
# `hyper` keys are the optimizer's own names (translated by the caller for torch).
GROUPS: tuple[dict[str, Any], ...] = (
    {"sizes": (0, 1, 7), "hyper": {"weight_decay": 0.0}},
    {"sizes": (4097,), "hyper": {"lr": 3e-3, "weight_decay": 0.1}},
    {"sizes": (1_000_003,), "hyper": {"lr": 5e-4, "weight_decay": 0.01}},
)


def make_params(sizes: Sequence[int], seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """Seeded leaf parameters of the given sizes."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=generator).to(dtype)) for n in sizes]


def param_groups(
    seed: int, hyper_extra: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """GROUPS as torch param-group dicts with fresh seeded parameters."""
    groups = []
    for index, spec in enumerate(GROUPS):
        hyper = {**spec["hyper"], **(hyper_extra or {}).get(index, {})} if hyper_extra else dict(spec["hyper"])
        groups.append({"params": make_params(spec["sizes"], seed + index, dtype), **hyper})
    return groups


def clone_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same groups with cloned parameters (a reference optimizer's copy)."""
    return [{**g, "params": [torch.nn.Parameter(p.detach().clone()) for p in g["params"]]} for g in groups]


_NOISE: dict[tuple[int, int], torch.Tensor] = {}


def _noise(numel: int, position: int) -> torch.Tensor:
    """Seeded noise per (size, position), made once: drawing 1M normals every step would dominate the test."""
    key = (numel, position)
    if key not in _NOISE:
        _NOISE[key] = torch.randn(2 * numel + 5, generator=torch.Generator().manual_seed(1000 + position))
    return _NOISE[key]


def set_grads(step: int, *param_lists: Sequence[torch.Tensor]) -> None:
    """Give every list the same gradient per position: a different slice and scale of seeded noise each step.

    The lists share one gradient tensor per position (the optimizers only read gradients).
    """
    scale = 1.0 + (step % 7) * 0.5
    for position, params in enumerate(zip(*param_lists, strict=True)):
        numel = params[0].numel()
        offset = (step * 7919) % (numel + 5)
        grad = _noise(numel, position)[offset : offset + numel].view(params[0].shape) * scale
        for param in params:
            param.grad = grad if grad.dtype == param.dtype else grad.to(param.dtype)


def flat(groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    return [p for g in groups for p in g["params"]]


def run_lockstep(
    ours: torch.optim.Optimizer,
    ours_params: list[torch.Tensor],
    reference: Callable[[int], None],
    ref_params: list[torch.Tensor],
    steps: int = STEPS,
) -> None:
    """Step both optimizers `steps` times on identical gradients; `reference(step)` steps the reference."""
    for step in range(steps):
        set_grads(step, ours_params, ref_params)
        ours.step()
        reference(step)


def lion_reference_step(
    params: list[torch.Tensor],
    states: dict[int, torch.Tensor],
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
) -> None:
    """Lion written with torch tensor ops (Chen et al. 2023), each product rounded on its own."""
    beta1, beta2 = betas
    with torch.no_grad():
        for param in params:
            if param.grad is None:
                continue
            exp_avg = states.setdefault(id(param), torch.zeros_like(param))
            grad = param.grad
            param.mul_(1 - lr * weight_decay)
            update = exp_avg * beta1 + grad * (1 - beta1)
            param.add_(torch.sign(update), alpha=-lr)
            exp_avg.mul_(beta2).add_(grad * (1 - beta2))
