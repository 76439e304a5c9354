"""Shared pieces of the distributed ds-zero tests: a small model with awkward sizes, data, and rank functions.

The model has parameter counts not divisible by 2 or 4, a frozen layer inside the forward pass, a
registered buffer, and is split into two optimizer param groups with their own lr / weight decay.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

import ds_zero

IN, OUT = 7, 3
GLOBAL_BATCH = 8  # split evenly over 2 or 4 ranks


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(IN, 13)  # 104
        self.scale = nn.Parameter(torch.ones(13) * 0.9)  # 13 -> group A: 104 + 13 + 36 = 153
        self.mid = nn.Linear(13, 9, bias=False)  # 117 -> group B
        self.frozen = nn.Linear(9, 11)  # frozen: not partitioned
        self.head = nn.Linear(11, OUT)  # 36
        self.frozen.requires_grad_(False)
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, OUT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x) * self.scale)
        h = torch.tanh(self.mid(h))
        h = torch.tanh(self.frozen(h))
        return self.head(h) + self.offset


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().to(dtype)


def param_groups(model: Tiny, lr_a: float = 1e-2, lr_b: float = 5e-3) -> list[dict[str, Any]]:
    group_a = [model.emb.weight, model.emb.bias, model.scale, model.head.weight, model.head.bias]
    group_b = [model.mid.weight, model.frozen.weight, model.frozen.bias]  # frozen ones stay frozen
    return [{"params": group_a, "lr": lr_a, "weight_decay": 0.01}, {"params": group_b, "lr": lr_b, "weight_decay": 0.0}]


def make_optimizer(model: Tiny) -> torch.optim.Optimizer:
    return torch.optim.AdamW(param_groups(model), betas=(0.9, 0.99), foreach=False)


def batch(step: int, micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global micro-batch `(step, micro)`: the same global data at any world size."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x.to(next(model.parameters()).dtype))
    return (out.float() - y).pow(2).mean()


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])


def zero_config(stage: int, **overrides: Any) -> ds_zero.ZeroConfig:
    """Small buckets, so even this model has several (buckets straddle partitions and param groups)."""
    base = {"stage": stage, "reduce_bucket_size": 100, "allgather_bucket_size": 200}
    base.update(overrides)
    return ds_zero.ZeroConfig(**base)


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def train_zero(
    opt: ds_zero.DeepSpeedZeroOptimizer,
    model: nn.Module,
    rank: int,
    world: int,
    steps: range,
    gas: int = 1,
    sched: Any = None,
    global_loss: bool = True,
) -> list[float]:
    """Run `steps` optimizer steps of `gas` micro-steps each; returns the loss per step (the mean over
    ranks with `global_loss`, else this rank's, which saves a collective per step)."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(gas):
            x, y = batch(step, micro, rank, world)
            loss = loss_fn(model, x, y)
            opt.backward(loss / gas)
            total += loss.item() / gas
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(_global_mean(total) if global_loss else total)
    return losses


def _global_mean(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
        t /= torch.distributed.get_world_size()
    return float(t)


def train_ddp(rank: int, world: int, steps: int, gas: int, clip: float) -> tuple[torch.Tensor, list[float]]:
    """The reference: torch DDP + AdamW (+ clip_grad_norm_) on the same data, same schedule."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = make_optimizer(model)
    sched = schedule(opt)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            x, y = batch(step, micro, rank, world)
            ctx = ddp.no_sync() if micro < gas - 1 else _null()
            with ctx:
                loss = loss_fn(ddp, x, y)
                (loss / gas).backward()
            total += loss.item() / gas
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
    return flat_params(model), losses


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def compare_with_ddp(rank: int, world: int, cases: list[dict[str, Any]], steps: int = 20) -> dict[str, tuple]:
    """For each case: (max |param diff|, max |loss diff|, max param spread across ranks, last grad norm) vs DDP.

    Losses are this rank's (same data as DDP's rank); DDP references are shared by cases with the same
    accumulation and clipping.
    """
    results, references = {}, {}
    for case in cases:
        case = dict(case)
        name = case.pop("name")
        gas = case.pop("gas", 1)
        clip = case.pop("clip", 0.0)
        stage = case.pop("stage")
        extra = {k: case.pop(k) for k in ("gradient_predivide_factor", "communication_dtype") if k in case}
        if (gas, clip) not in references:
            references[(gas, clip)] = train_ddp(rank, world, steps, gas, clip)
        ref_params, ref_losses = references[(gas, clip)]
        model = make_model()
        opt = ds_zero.DeepSpeedZeroOptimizer(
            make_optimizer(model), config=zero_config(stage, **case), module=model, clip_grad=clip, **extra
        )
        losses = train_zero(opt, model, rank, world, range(steps), gas=gas, sched=schedule(opt), global_loss=False)
        params = flat_params(model)
        spread = _spread(params)
        results[name] = (
            float((params - ref_params).abs().max()),
            max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            spread,
            opt.global_grad_norm,
        )
        opt.close()
    return results


def _spread(t: torch.Tensor) -> float:
    """Max difference of `t` between this rank and rank 0 (params must be identical everywhere)."""
    ref = t.clone()
    torch.distributed.broadcast(ref, src=0)
    return float((t - ref).abs().max())


def isfinite_all(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)
