"""ZenFlow's math in plain PyTorch, written from its rules alone: the reference every ZenFlow test compares with.

Columns are picked by the sum of |gradient| (`choose`; by default the top `max(1, int(ratio * columns))`
of the whole weight), torch's `AdamW` updates the selected columns only (its moments cleared at each
reselection, its step count kept), the rest of the gradient is summed on the side and applied every
`update_interval` steps by a hand-written Adam(W) whose bias correction counts micro steps, with the
selected columns kept out of that update (they are put back and updated by AdamW after it).

`zero3_columns` is DeepSpeed 0.19.8's ZeRO-3 choice, restated: the weight is split transposed (column
after column) into `world` pieces of `ceil(numel / world)` elements, only the columns wholly inside one
piece may be chosen, and one top `max(1, int(ratio * those columns))` is taken over them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8

Choose = Callable[[torch.Tensor, float], torch.Tensor]


def whole_columns(g: torch.Tensor, ratio: float) -> torch.Tensor:
    """The top `max(1, int(ratio * columns))` columns of `g` by sum of |g| (ZeRO 1/2 at world size 1)."""
    k = max(1, int(g.shape[1] * ratio))
    return torch.topk(g.abs().sum(dim=0), k).indices.sort().values


def zero3_columns(world: int) -> Choose:
    """DeepSpeed's ZeRO-3 column choice at `world` ranks (module note)."""

    def choose(g: torch.Tensor, ratio: float) -> torch.Tensor:
        rows, cols = g.shape
        numel = rows * cols
        piece = math.ceil(numel / world)
        eligible: list[int] = []
        for r in range(world):
            lo, hi = r * piece, min((r + 1) * piece, numel)
            eligible += range(math.ceil(lo / rows), hi // rows) if lo < numel else []
        sums = g.abs().sum(dim=0)[eligible]
        top = torch.topk(sums, max(1, int(len(eligible) * ratio))).indices
        return torch.tensor(eligible)[top].sort().values

    return choose


def adamw_cpu(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    """DeepSpeed's CPU AdamW on all elements, bias correction at `step`."""
    p.mul_(1 - LR * WD)
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v / (1 - BETAS[1] ** step)).sqrt().add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** step))


def reference_run(
    model: nn.Module,
    loss_at: Callable[[nn.Module, int], torch.Tensor],
    num_steps: int,
    *,
    ratio: float,
    select: int,
    update: int,
    warm: int,
    choose: Choose = whole_columns,
    auto_ratio: float | None = None,
) -> list[int]:
    """Train `model` for `num_steps` micro steps of ZenFlow; `loss_at(model, m)` is micro step m's loss
    (already divided by `update`; the mean over the ranks' losses for a multi-rank run). Returns the micro
    steps after which the CPU update ran.

    With `auto_ratio` (`update_interval: "auto"`; `update` unused, losses not divided) a window ends when,
    for at least `int(auto_ratio * 2-D weights)` weights, the running sum of the left-out |gradient|
    (scaled by 1 / (10 (1 - ratio))) has reached the running average of the selected |gradient|
    (averaged over the window and scaled by 1 / (10 ratio) at each step), or before a reselection; the
    CPU update then applies the window's mean gradient."""
    params = list(model.parameters())
    matrices = [i for i, p in enumerate(params) if p.dim() == 2]
    window, avg, non = 0, [0.0] * len(params), [0.0] * len(params)
    boundaries = []
    acc = [torch.zeros_like(p) for p in params]
    cpu_m = [torch.zeros_like(p) for p in params]
    cpu_v = [torch.zeros_like(p) for p in params]
    cols: list[torch.Tensor | None] = [None] * len(params)
    sel_opt: list[torch.optim.AdamW | None] = [None] * len(params)
    sel_vals: list[torch.Tensor | None] = [None] * len(params)
    for m in range(num_steps):
        model.zero_grad()
        loss_at(model, m).backward()
        grads = [p.grad.detach().clone() for p in params]
        after = m - warm
        reselect = after >= 0 and (after == 0 or m % select == 0)
        if auto_ratio is None:
            boundary = m + 1 < warm or (m + 1 - warm) % update == 0 or (m + 1) % select == 0
        else:
            boundary = m + 1 <= warm or (select != 0 and (m + 1) % select == 0)
        if reselect:
            for i, g in enumerate(grads):
                if g.dim() == 2:
                    cols[i] = choose(g, ratio)
                state = sel_opt[i].state if sel_opt[i] is not None else {}
                for s in state.values():  # new selection: moments cleared, step counts kept
                    s["exp_avg"].zero_()
                    s["exp_avg_sq"].zero_()
        saved = []
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            acc[i] += g
            if after < 0:
                continue
            idx = cols[i]
            value = p.detach()[:, idx].clone() if idx is not None else p.detach().clone()
            grad = g[:, idx] if idx is not None else g
            if sel_opt[i] is None:
                sel_vals[i] = nn.Parameter(value)
                sel_opt[i] = torch.optim.AdamW([sel_vals[i]], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
            saved.append((i, idx, value, grad))
        if auto_ratio is not None and after >= 0:
            window += 1
            need = 0
            for i in matrices:
                critical = float(grads[i][:, cols[i]].abs().sum())
                avg[i] = (avg[i] * (window - 1) + critical) / window / (ratio * 10)
                non[i] += (float(grads[i].abs().sum()) - critical) / ((1 - ratio) * 10)
                need += non[i] >= avg[i]
            boundary = boundary or need >= int(auto_ratio * len(matrices))
        if boundary:
            boundaries.append(m)
            with torch.no_grad():
                for i, p in enumerate(params):
                    mean = acc[i] / max(1, window) if auto_ratio is not None else acc[i]
                    adamw_cpu(p.data, mean, cpu_m[i], cpu_v[i], m + 1)
                    acc[i].zero_()
            window, non = 0, [0.0] * len(params)
        for i, idx, value, grad in saved:  # the selected columns skip the CPU update: before it, then AdamW
            with torch.no_grad():
                sel_vals[i].copy_(value)
            sel_vals[i].grad = grad
            sel_opt[i].step()
            with torch.no_grad():
                if idx is not None:
                    params[i].data[:, idx] = sel_vals[i].detach()
                else:
                    params[i].data.copy_(sel_vals[i].detach())
    return boundaries
