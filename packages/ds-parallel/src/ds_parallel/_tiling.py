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

    DeepSpeed's contract: `x` (`[batch, seq, hidden]`) and `y` (`[batch, seq, ...]`, the labels) are flattened
    over batch and sequence and cut into `shards` tiles (`torch.chunk`: the last may be shorter, and there may
    be fewer tiles than asked when the tokens do not fill them); `fn(module, x_tile, y_tile)` returns the
    tile's loss, with `mask_tile` as a fourth argument when `mask` (`[batch, seq]`) is given. The result is
    the tiles' losses summed (`"sum"`) or averaged (`"mean"`, over tiles). So an `fn` that averages over its
    tokens gives the whole sequence's mean only when the tiles hold equal numbers of counted tokens; for
    uneven tiles or masks, return a sum from `fn`, ask for `"sum"` and divide by the token count yourself.
    The logits exist one tile at a time, in forward and in the backward recomputation.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        module: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        mask: torch.Tensor | None,
        shards: int,
        compute_params: Iterable[nn.Parameter] | None = None,
        output_reduction: Literal["mean", "sum"] = "mean",
    ) -> torch.Tensor:
        if output_reduction not in ("mean", "sum"):
            raise ValueError(
                f"TiledFusedLogitsLoss: output_reduction must be 'mean' or 'sum', got {output_reduction!r}"
            )
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"TiledFusedLogitsLoss: labels of shape {tuple(y.shape)} do not match hidden states "
                f"{tuple(x.shape)}: both must be [batch, seq, ...] with the same batch and seq"
            )
        if mask is not None and mask.shape != x.shape[:2]:
            raise ValueError(
                f"TiledFusedLogitsLoss: mask of shape {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}"
            )
        _check_shards(shards, x.size(0) * x.size(1), "TiledFusedLogitsLoss")
        ctx.fn, ctx.module, ctx.shards, ctx.has_mask = fn, module, shards, mask is not None
        ctx.save_for_backward(x, y, mask)
        with torch.no_grad():
            losses = [fn(module, *tile).reshape(()) for tile in _flat_tiles(x, y, mask, shards)]
        ctx.scale = 1.0 / len(losses) if output_reduction == "mean" else 1.0
        total = torch.stack(losses).sum()
        return total * ctx.scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, y, mask = ctx.saved_tensors
        wants_grad = ctx.needs_input_grad[2]
        x_grad = x.new_empty((x.size(0) * x.size(1), *x.shape[2:])) if wants_grad else None
        offset = 0
        for xt, *rest in _flat_tiles(x, y, mask if ctx.has_mask else None, ctx.shards):
            xt = xt.detach().requires_grad_(wants_grad)
            with torch.enable_grad():
                loss = ctx.fn(ctx.module, xt, *rest).reshape(())
            if loss.requires_grad:
                torch.autograd.backward(loss, (grad * ctx.scale).to(loss.dtype))
            if x_grad is not None:
                x_grad.narrow(0, offset, xt.size(0)).copy_(xt.grad if xt.grad is not None else torch.zeros_like(xt))
            offset += xt.size(0)
        return None, None, None if x_grad is None else x_grad.view_as(x), None, None, None, None, None


def _flat_tiles(
    x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, shards: int
) -> list[tuple[torch.Tensor, ...]]:
    """`(x, y[, mask])` flattened over batch and sequence, then cut into tiles along that token dimension."""
    parts = [x.reshape(-1, *x.shape[2:]), y.reshape(-1, *y.shape[2:])]
    if mask is not None:
        parts.append(mask.reshape(-1))
    return list(zip(*(part.chunk(shards, dim=0) for part in parts), strict=True))
