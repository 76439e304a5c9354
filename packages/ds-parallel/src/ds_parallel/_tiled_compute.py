"""Any sequence-local function computed a tile of the sequence at a time (ALST's generic tiling).

`TiledMLP` is the case of an MLP; this is the same memory trade for any `fn` whose output at a sequence
position depends only on that position's inputs: the forward runs tile by tile without a graph and keeps
only the inputs; backward recomputes one tile at a time with grad on, so peak extra memory is one tile's
intermediates. Inputs to tile are `[batch, seq, ...]` and are cut along dim 1; the tiles' outputs are put
back together along `output_unshard_dimension` (0: one scalar per tile, stacked), then optionally summed or
averaged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn

__all__ = ["SequenceTiledCompute", "sequence_tiled_compute"]

Reduction = Literal["mean", "sum"] | None


def _tiles(tensor: torch.Tensor, step: int, count: int) -> list[torch.Tensor]:
    return [tensor[:, i * step : (i + 1) * step] for i in range(count)]


def _join(outputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    return torch.stack(outputs) if dim == 0 else torch.cat(outputs, dim=dim)


def _reduce(output: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    return output if reduction is None else output.mean() if reduction == "mean" else output.sum()


class SequenceTiledCompute(torch.autograd.Function):
    """The autograd function behind `sequence_tiled_compute` (use that: it takes the keyword dicts).

    `apply(fn, seqlen, shards, keys_to_shard, keys_to_pass, grad_key, compute_params,
    output_unshard_dimension, output_reduction, *values)`, where `values` are the tiled inputs in
    `keys_to_shard` order followed by the passed-through ones in `keys_to_pass` order. The gradient flows
    to the `grad_key` input (tiled) and to the parameters `fn` uses; `compute_params` is DeepSpeed's list
    of those parameters, accepted for its signature: ds's ZeRO gathers and reduces them through the
    modules' own hooks during the recomputation.
    """

    @staticmethod
    def forward(
        ctx: Any,
        fn: Callable[..., torch.Tensor],
        seqlen: int,
        shards: int,
        keys_to_shard: list[str],
        keys_to_pass: list[str],
        grad_key: str,
        compute_params: Iterable[nn.Parameter] | None,
        output_unshard_dimension: int,
        output_reduction: Reduction,
        *values: Any,
    ) -> torch.Tensor:
        sharded = dict(zip(keys_to_shard, values[: len(keys_to_shard)], strict=True))
        passed = dict(zip(keys_to_pass, values[len(keys_to_shard) :], strict=True))
        step = math.ceil(seqlen / shards)
        count = math.ceil(seqlen / step)  # never an empty tile (9 positions in 4 shards of 3: three tiles)
        tiles = {k: _tiles(v, step, count) for k, v in sharded.items()}
        with torch.no_grad():
            outputs = [fn(**{k: t[i] for k, t in tiles.items()}, **passed) for i in range(count)]
            joined = _join(outputs, output_unshard_dimension)
        ctx.fn, ctx.passed, ctx.step, ctx.count = fn, passed, step, count
        ctx.keys_to_shard, ctx.grad_key, ctx.grad_index = keys_to_shard, grad_key, keys_to_shard.index(grad_key)
        ctx.dim, ctx.reduction, ctx.numel = output_unshard_dimension, output_reduction, joined.numel()
        # where each tile's output starts in the joined one (tiles may differ in length: the last is shorter)
        sizes = [1 if output_unshard_dimension == 0 else o.size(output_unshard_dimension) for o in outputs]
        ctx.out_starts = [sum(sizes[:i]) for i in range(count)]
        ctx.save_for_backward(*sharded.values())
        return _reduce(joined, output_reduction)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        sharded = dict(zip(ctx.keys_to_shard, ctx.saved_tensors, strict=True))
        wants_grad = ctx.needs_input_grad[9 + ctx.grad_index]
        tiles = {k: _tiles(v, ctx.step, ctx.count) for k, v in sharded.items()}
        target = sharded[ctx.grad_key]
        target_grad = torch.zeros_like(target) if wants_grad else None
        start = 0
        for i in range(ctx.count):
            inputs = {k: t[i] for k, t in tiles.items()}
            length = inputs[ctx.grad_key].size(1)
            inputs[ctx.grad_key] = inputs[ctx.grad_key].detach().requires_grad_(wants_grad)
            with torch.enable_grad():
                out = ctx.fn(**inputs, **ctx.passed)
            if ctx.reduction is None:  # this tile's slice of the incoming gradient
                out_grad = grad[i] if ctx.dim == 0 else grad.narrow(ctx.dim, ctx.out_starts[i], out.size(ctx.dim))
            else:
                scale = grad / ctx.numel if ctx.reduction == "mean" else grad
                out_grad = scale.expand_as(out).to(out.dtype)
            if out.requires_grad:
                torch.autograd.backward(out, out_grad)
            tile_grad = inputs[ctx.grad_key].grad
            if target_grad is not None and tile_grad is not None:
                target_grad.narrow(1, start, length).copy_(tile_grad)
            start += length
        grads: list[torch.Tensor | None] = [None] * (9 + len(sharded) + len(ctx.passed))
        grads[9 + ctx.grad_index] = target_grad
        return tuple(grads)


def sequence_tiled_compute(
    fn: Callable[..., torch.Tensor],
    seqlen: int,
    shards: int,
    kwargs_to_shard: Mapping[str, torch.Tensor],
    kwargs_to_pass: Mapping[str, Any],
    grad_requiring_tensor_key: str,
    compute_params: Iterable[nn.Parameter] | None = None,
    output_unshard_dimension: int = 1,
    output_reduction: Reduction = "mean",
) -> torch.Tensor:
    """`fn(**tile_of(kwargs_to_shard), **kwargs_to_pass)` over `shards` tiles of the sequence (DeepSpeed's API).

    Args:
        fn: called once per tile in forward and again in backward (so it runs twice per step); its output at
            a position must depend only on that position's inputs.
        seqlen: the length of dim 1 of every tensor in `kwargs_to_shard`.
        shards: how many tiles to aim for; each is `ceil(seqlen / shards)` long, the last shorter when it does
            not divide, and there are fewer when the last would be empty (9 positions, 4 shards: 3, 3, 3).
        kwargs_to_shard: `[batch, seq, ...]` tensors, cut along dim 1.
        kwargs_to_pass: passed to every call unchanged (a module, a mask that is not per position...).
        grad_requiring_tensor_key: the key in `kwargs_to_shard` that gets a gradient.
        compute_params: the parameters `fn` uses (DeepSpeed's signature; ds's ZeRO needs no list).
        output_unshard_dimension: where the tiles' outputs are joined; 0 stacks one scalar per tile.
        output_reduction: None (the joined output), "mean" or "sum" over it.

    Raises:
        ValueError: bad shards, a key missing, or an unknown reduction, before any compute.
    """
    if output_reduction not in (None, "mean", "sum"):
        raise ValueError(
            f"sequence_tiled_compute: output_reduction must be None, 'mean' or 'sum', got {output_reduction!r}"
        )
    if not isinstance(shards, int) or not 1 <= shards <= seqlen:
        raise ValueError(f"sequence_tiled_compute: shards must be an int in [1, seqlen={seqlen}], got {shards!r}")
    if grad_requiring_tensor_key not in kwargs_to_shard:
        raise ValueError(
            f"sequence_tiled_compute: grad_requiring_tensor_key {grad_requiring_tensor_key!r} is not one of the "
            f"tiled inputs {sorted(kwargs_to_shard)}"
        )
    for key, value in kwargs_to_shard.items():
        if value.dim() < 2 or value.size(1) != seqlen:
            raise ValueError(
                f"sequence_tiled_compute: kwargs_to_shard[{key!r}] has shape {tuple(value.shape)}; every tiled "
                f"input must be [batch, seqlen={seqlen}, ...]"
            )
    return SequenceTiledCompute.apply(
        fn,
        seqlen,
        shards,
        list(kwargs_to_shard),
        list(kwargs_to_pass),
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *kwargs_to_shard.values(),
        *kwargs_to_pass.values(),
    )
