"""ALST's sequence tiling: an MLP and a logits+loss computed a tile of the sequence at a time.

At long sequence lengths the MLP's intermediate activations (`[s, intermediate]`) and the logits
(`[s, vocab]`) dominate a layer's memory even when the sequence is sharded. Both functions here run
their computation tile by tile without building a graph, keep only the input, and in backward
recompute one tile at a time with grad enabled, accumulating parameter gradients tile by tile. Peak
extra memory is one tile's intermediates instead of the whole sequence's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["TiledFusedLogitsLoss", "TiledMLP"]


def _check_shards(shards: int, length: int, what: str) -> None:
    if not isinstance(shards, int) or shards < 1:
        raise ValueError(f"{what}: shards must be a positive int, got {shards!r}")
    if shards > length:
        raise ValueError(f"{what}: {shards} shards for a sequence of {length}; use at most {length}")


class TiledMLP(torch.autograd.Function):
    """`TiledMLP.apply(fn, module, x, shards, compute_params)`: `fn(module, x)` over `shards` tiles of the sequence.

    `x` is `[..., seq, hidden]` (tiled along dim -2); `fn` must act on each position independently (an
    MLP does). `compute_params` is accepted for DeepSpeed's signature (the parameters `fn` uses); the
    recomputation gathers ZeRO-3 parameters through the module's own hooks.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
        module: nn.Module,
        x: torch.Tensor,
        shards: int,
        compute_params: Iterable[nn.Parameter] | None = None,
    ) -> torch.Tensor:
        _check_shards(shards, x.size(-2), "TiledMLP")
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, tile) for tile in x.chunk(shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        offset = 0
        for tile, tile_grad in zip(x.chunk(ctx.shards, dim=-2), grad.chunk(ctx.shards, dim=-2), strict=True):
            tile = tile.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                out = ctx.fn(ctx.module, tile)
            torch.autograd.backward(out, tile_grad)
            if x_grad is not None:
                x_grad.narrow(-2, offset, tile.size(-2)).copy_(tile.grad)
            offset += tile.size(-2)
        return None, None, x_grad, None, None


class TiledFusedLogitsLoss(torch.autograd.Function):
    """`TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)`.

    `fn(module, x_tile, y_tile)` returns the tile's loss summed over its tokens (e.g. the lm head and a
    cross-entropy with `reduction="sum"`); the logits exist one tile at a time. `x` is
    `[..., seq, hidden]` (tiled along dim -2), `y` the matching `[..., seq]` labels (tiled along dim -1).
    `output_reduction="sum"` returns the sum over tiles; `"mean"` divides it by the tokens that count:
    `mask.sum()` (a bool `[..., seq]` tensor), or `y.numel()` without a mask.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
        module: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Iterable[nn.Parameter] | None = None,
        output_reduction: Literal["mean", "sum"] = "mean",
    ) -> torch.Tensor:
        _check_shards(shards, x.size(-2), "TiledFusedLogitsLoss")
        if output_reduction not in ("mean", "sum"):
            raise ValueError(
                f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}"
            )
        if y.shape != x.shape[:-1]:
            raise ValueError(
                f"TiledFusedLogitsLoss: labels of shape {tuple(y.shape)} do not match hidden states "
                f"{tuple(x.shape)} (expected {tuple(x.shape[:-1])})"
            )
        count = (mask.sum() if mask is not None else torch.tensor(y.numel())).to(torch.float32)
        ctx.scale = 1.0 / max(float(count), 1.0) if output_reduction == "mean" else 1.0
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x, y)
        with torch.no_grad():
            total = sum(
                fn(module, xt, yt).float()
                for xt, yt in zip(x.chunk(shards, dim=-2), y.chunk(shards, dim=-1), strict=True)
            )
        return (total * ctx.scale).to(x.dtype if x.is_floating_point() else torch.float32)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, y = ctx.saved_tensors
        x_grad = torch.empty_like(x) if ctx.needs_input_grad[2] else None
        offset = 0
        for xt, yt in zip(x.chunk(ctx.shards, dim=-2), y.chunk(ctx.shards, dim=-1), strict=True):
            xt = xt.detach().requires_grad_(x_grad is not None)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, xt, yt).float() * ctx.scale
            torch.autograd.backward(loss, grad.float())
            if x_grad is not None:
                x_grad.narrow(-2, offset, xt.size(-2)).copy_(xt.grad)
            offset += xt.size(-2)
        return None, None, x_grad, None, None, None, None, None
