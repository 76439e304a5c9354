"""LM-head projection fused with cross entropy: `CE(hidden @ weight.T + bias, target)` without the logits.

The `[tokens, vocab]` logits of a long sequence dwarf every other activation. Forward walks the tokens in
row chunks, keeping only each token's softmax statistics (max, sum of exponentials); backward recomputes
one chunk of logits at a time from the saved hidden states and turns it straight into the hidden, weight
and bias gradients. Peak extra memory is one `[chunk, local_vocab]` block.

`weight` may be this rank's rows of a vocabulary-parallel head: the statistics are combined across
`tp_group` as in `vocab_parallel_cross_entropy`, and the hidden gradient (a partial sum over this rank's
vocabulary rows) is all-reduced, as a column-parallel layer's backward does.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._vocab_shard import check_targets, global_sp_sum, is_parallel, resolve_vocab_metadata

__all__ = ["vocab_parallel_linear_cross_entropy"]


def _default_chunk_rows(tokens: int, global_vocab: int, tp_world: int, hidden: int) -> int:
    """Rows per chunk so one logits block is about the size of `hidden` (same on every TP rank)."""
    chunks = max(1, math.ceil(math.ceil(global_vocab / tp_world) / hidden))
    return max(1, math.ceil(tokens / chunks))


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        tp_group: ProcessGroup | None,
        start: int,
        end: int,
        ignore_index: int,
        chunk_rows: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        tokens, local = hidden.shape[0], weight.shape[0]
        stat = _stat_dtype(compute_dtype)
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        valid = target != ignore_index
        mine = valid & (target >= start) & (target < end)
        local_target = (target - start).clamp(0, local - 1)
        loss = torch.empty(tokens, dtype=stat, device=hidden.device)
        row_max, sum_exp = torch.empty_like(loss), torch.empty_like(loss)
        tp = is_parallel(tp_group)
        for lo in range(0, tokens, chunk_rows):
            hi = min(lo + chunk_rows, tokens)
            logits = F.linear(h[lo:hi], w, b).to(stat)
            m = logits.amax(dim=-1)
            if tp:
                ds_comm.all_reduce(m, op=ds_comm.ReduceOp.MAX, group=tp_group)
            logits -= m.unsqueeze(-1)
            picked = logits.gather(-1, local_target[lo:hi].unsqueeze(-1)).squeeze(-1)
            stats = torch.stack([logits.exp_().sum(dim=-1), torch.where(mine[lo:hi], picked, 0.0)])
            if tp:
                ds_comm.all_reduce(stats, group=tp_group)
            row_max[lo:hi], sum_exp[lo:hi] = m, stats[0]
            loss[lo:hi] = torch.where(valid[lo:hi], stats[0].log() - stats[1], 0.0)
        ctx.save_for_backward(hidden, weight, bias, valid, mine, local_target, row_max, sum_exp)
        ctx.tp_group, ctx.chunk_rows, ctx.compute_dtype = tp_group, chunk_rows, compute_dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, valid, mine, local_target, row_max, sum_exp = ctx.saved_tensors
        cd, rows_per = ctx.compute_dtype, ctx.chunk_rows
        stat = _stat_dtype(cd)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        h, w = hidden.to(cd), weight.to(cd)
        b = None if bias is None else bias.to(cd)
        token_grad = torch.where(valid, grad_loss.to(stat), 0.0)
        scale = token_grad / sum_exp
        grad_h = torch.empty(hidden.shape, dtype=stat, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=stat, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=stat, device=bias.device) if need_b and bias is not None else None
        for lo in range(0, hidden.shape[0], rows_per):
            hi = min(lo + rows_per, hidden.shape[0])
            logits = F.linear(h[lo:hi], w, b).to(stat)
            # d loss / d logits = (softmax - onehot) * upstream, in place on the recomputed block
            g = logits.sub_(row_max[lo:hi].unsqueeze(-1)).exp_().mul_(scale[lo:hi].unsqueeze(-1))
            g.scatter_add_(-1, local_target[lo:hi].unsqueeze(-1), -(token_grad[lo:hi] * mine[lo:hi]).unsqueeze(-1))
            if grad_b is not None:
                grad_b += g.sum(dim=0)
            gc = g.to(cd)
            if grad_w is not None:
                grad_w += (gc.t() @ h[lo:hi]).to(stat)
            if grad_h is not None:
                grad_h[lo:hi] = (gc @ w).to(stat)
        if grad_h is not None and is_parallel(ctx.tp_group):
            ds_comm.all_reduce(grad_h, group=ctx.tp_group)
        return (
            None if grad_h is None else grad_h.to(hidden.dtype),
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            *([None] * 7),
        )


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    tp_group: ProcessGroup | None = None,
    sp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross entropy of `hidden @ weight.T (+ bias)` against `target`, never holding all the logits.

    Args:
        hidden: `[..., hidden]`, identical on every TP rank.
        weight: `[local_vocab, hidden]`, this rank's rows of the LM head (the whole head without TP).
        target: `[...]` global token ids (`ignore_index` skips a position).
        chunk_size: tokens per chunk (default: a logits block about as large as `hidden`).
        reduction: "none" (per token, zeros at ignored positions, not reduced over `sp_group`), "sum" or
            "mean" over the valid tokens of the whole sequence group.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction={reduction!r}: expected one of ('none', 'sum', 'mean')")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} must agree in every dim but the last"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [local_vocab, {hidden.shape[-1]}]")
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together (or neither)")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size}: must be a positive number of tokens")
    start, end, total = resolve_vocab_metadata(
        weight.shape[0], vocab_start_index, vocab_end_index, tp_group, hidden.device
    )
    shape = target.shape
    flat_target = target.reshape(-1).to(torch.long)
    check_targets(flat_target, ignore_index, total)
    flat = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    if chunk_size is None:
        world = ds_comm.get_world_size(tp_group) if tp_group is not None else 1
        chunk_size = _default_chunk_rows(flat.shape[0], total, world, flat.shape[1])
    compute = _autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)
    with torch.autocast(hidden.device.type, enabled=False):
        per_token = _LinearCE.apply(
            flat, weight.contiguous(), bias, flat_target, tp_group, start, end, ignore_index, chunk_size, compute
        )
    if reduction == "none":
        return per_token.view(shape)
    loss = per_token.sum()
    if reduction == "mean":
        count = (flat_target != ignore_index).sum().to(loss.dtype)
        if is_parallel(sp_group):
            ds_comm.all_reduce(count, group=sp_group)
        loss = loss / count.clamp_min(1)
    return global_sp_sum(loss, sp_group)
