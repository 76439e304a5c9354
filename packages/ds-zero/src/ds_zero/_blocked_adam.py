"""Step a client's torch Adam/AdamW over cache-sized blocks of the flat partitions: the same bits, less time.

Why: ZeRO-1/2 gives the client's optimizer one flat fp32 partition per group (10M elements and more).
torch's Adam runs each of its elementwise operations over the whole tensor before the next one, so every
operation streams the 40 MB parameter, gradient and moment tensors from memory again, and its temporaries
(the square root of the second moment, its quotient) are fresh 40 MB allocations, which glibc serves with
`mmap` (above its 32 MiB threshold): the kernel maps and zero-fills their pages on every step. Calling
torch's own functional `adam` on one block at a time keeps the block's tensors in cache across the
operations and its temporaries small enough for the heap. On the 21M GPT's 10.5M-element partition this
took the client's AdamW(foreach=True) from ~50 ms to ~31 ms per rank and step on this host.

Each element goes through the same operations on the same values, so the result equals `optimizer.step()`
bit for bit (tests/test_blocked_adam.py, with one and two intra-op threads). Blocks start at multiples of
`BLOCK`, a multiple of 64 elements, so the vectorised kernels split them as they split the whole tensor.
Anything this path does not reproduce exactly falls back to `optimizer.step()`: another optimizer class
(a subclass may override `step`), amsgrad / maximize / capturable / differentiable / fused, tensor
hyper-parameters, step hooks, AMP's grad scaling, and the first step (torch creates the state there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer
from torch.optim.adam import adam

BLOCK = 1 << 18
"""Elements per call: 1 MiB per fp32 tensor, so a block's five tensors and temporaries stay in cache."""

_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW)
_OFF = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def step_in_blocks(optimizer: torch.optim.Optimizer) -> bool:
    """Run one `optimizer.step()` of a plain torch Adam/AdamW block by block; False (nothing done) otherwise."""
    plan = _plan(optimizer)
    if plan is None:
        return False
    with torch.no_grad():
        for group, params in plan:
            _step_group(optimizer, group, params)
    # torch's LR schedulers check that the optimizer stepped before them (a warning otherwise)
    optimizer._opt_called = True  # type: ignore[attr-defined]
    return True


def _plan(optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], list[torch.Tensor]]] | None:
    """The groups and their parameters with gradients, or None where only `optimizer.step()` is exact."""
    if type(optimizer) not in _OPTIMIZERS:
        return None
    hooks = (
        optimizer._optimizer_step_pre_hooks,
        optimizer._optimizer_step_post_hooks,
        torch_optimizer._global_optimizer_pre_hooks,
        torch_optimizer._global_optimizer_post_hooks,
    )
    amp = (getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None))
    if any(hooks) or any(value is not None for value in amp):
        return None
    plan = []
    for group in optimizer.param_groups:
        if any(group.get(key) for key in _OFF) or "decoupled_weight_decay" not in group:
            return None
        if any(isinstance(value, torch.Tensor) for value in (group["lr"], *group["betas"])):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = optimizer.state.get(p)
            if not state or not {"step", "exp_avg", "exp_avg_sq"} <= state.keys():
                return None
            if not isinstance(state["step"], torch.Tensor):  # a plain number (a loaded state): torch's step handles it
                return None
            tensors = (p, p.grad, state["exp_avg"], state["exp_avg_sq"])
            if p.is_complex() or p.grad.is_sparse or not all(t.is_contiguous() for t in tensors):
                return None
        plan.append((group, params))
    return plan


def _step_group(optimizer: torch.optim.Optimizer, group: dict[str, Any], params: list[torch.Tensor]) -> None:
    beta1, beta2 = group["betas"]
    for p in params:
        state = optimizer.state[p]
        flat = [t.view(-1) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
        steps = state["step"]
        for start in range(0, p.numel(), BLOCK):
            param, grad, exp_avg, exp_avg_sq = (t[start : start + BLOCK] for t in flat)
            adam(
                [param],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [],
                [steps.clone()],  # each block counts this step on its own copy; the state's once, below
                amsgrad=False,
                has_complex=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
                foreach=group["foreach"],
                capturable=False,
                differentiable=False,
                fused=None,
                grad_scale=None,
                found_inf=None,
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        steps += 1
