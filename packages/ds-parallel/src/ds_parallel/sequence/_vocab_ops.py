"""Per-token log-probabilities, entropy and KL divergence over vocabulary-sharded logits.

RL and on-policy distillation losses need these per token; with a vocabulary-parallel LM head they run on
the local logits shard, combining only per-token statistics across the tensor-parallel group. Each op is
written with differentiable torch ops as a sum over the ranks of per-shard partial terms: the result's sum
(`AllReduceSum`) has an identity backward, since every tensor-parallel rank back-propagates the same
replicated result, while the softmax normalizer's sum (`AllReduceSumOfPartials`) sums its gradient over
the ranks, each of which used it in its own partial term; autograd derives the rest.

The results are replicated over the group and in at least fp32. A row whose logits are all `-inf` has no
distribution: entropy and KL are NaN there and its logits get a zero gradient, so such rows (padding) can
be masked out by the caller.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._vocab_shard import (
    AllReduceSum,
    AllReduceSumOfPartials,
    check_targets,
    is_parallel,
    resolve_vocab_metadata,
)

__all__ = ["vocab_parallel_entropy", "vocab_parallel_kl_div", "vocab_parallel_logprobs"]

_NEG_INF = float("-inf")


def _log_softmax(logits: torch.Tensor, tp_group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log_softmax over the global vocabulary, undefined-row mask [..., 1])` of the local shard."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    with torch.no_grad():
        row_max = x.amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_full((*x.shape[:-1], 1), _NEG_INF)
        if is_parallel(tp_group):
            ds_comm.all_reduce(row_max, op=ds_comm.ReduceOp.MAX, group=tp_group)
        undefined = row_max == _NEG_INF
    # Undefined rows compute on zeros so that no NaN reaches their (zero) gradient.
    x = torch.where(undefined, 0.0, x)
    shifted = x - torch.where(undefined, 0.0, row_max)
    sum_exp = AllReduceSumOfPartials.apply(shifted.exp().sum(dim=-1, keepdim=True), tp_group)
    return shifted - sum_exp.log(), undefined


def _p_times(log_p: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`p * values` with tokens of probability exactly 0 (log p = -inf) contributing 0, even for infinite values."""
    zero = log_p == _NEG_INF
    return torch.where(zero, 0.0, log_p.exp() * torch.where(zero, 0.0, values))


def vocab_parallel_logprobs(
    vocab_parallel_logits: torch.Tensor,
    index: torch.Tensor,
    tp_group: ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    vocab_end_index: int | None = None,
    global_vocab_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Log-probabilities of the token ids `index` (the logits' leading shape, optionally with a top-k dim).

    Ids equal to `ignore_index` give 0. `index` must be the same on every tensor-parallel rank.
    """
    lead = vocab_parallel_logits.shape[:-1]
    single = index.shape == lead
    if not single and index.shape[:-1] != lead:
        raise ValueError(
            f"index {tuple(index.shape)} must be the logits' leading shape {tuple(lead)}, optionally followed by "
            f"a top-k dim"
        )
    if (vocab_start_index is None) != (vocab_end_index is None):
        raise ValueError("vocab_start_index and vocab_end_index must be given together (or neither)")
    if global_vocab_size is not None:
        if vocab_start_index is None:
            raise ValueError("global_vocab_size needs explicit vocab_start_index and vocab_end_index")
    else:
        vocab_start_index, vocab_end_index, global_vocab_size = resolve_vocab_metadata(
            vocab_parallel_logits.shape[-1], vocab_start_index, vocab_end_index, tp_group, vocab_parallel_logits.device
        )
    index = index.to(torch.long)
    check_targets(index, ignore_index, global_vocab_size, what="index")
    idx = index.unsqueeze(-1) if single else index
    log_p, _ = _log_softmax(vocab_parallel_logits, tp_group)
    local = vocab_parallel_logits.shape[-1]
    valid = idx != ignore_index
    mine = valid & (idx >= vocab_start_index) & (idx < vocab_start_index + local)
    picked = log_p.gather(-1, (idx - vocab_start_index).clamp(0, max(local - 1, 0)))
    out = AllReduceSum.apply(torch.where(mine, picked, 0.0), tp_group)
    out = torch.where(valid, out, 0.0)
    return out.squeeze(-1) if single else out


def vocab_parallel_entropy(vocab_parallel_logits: torch.Tensor, tp_group: ProcessGroup | None = None) -> torch.Tensor:
    """Per-token entropy of the softmax over the (sharded) vocabulary."""
    log_p, undefined = _log_softmax(vocab_parallel_logits, tp_group)
    entropy = AllReduceSum.apply(-_p_times(log_p, log_p).sum(dim=-1), tp_group)
    return torch.where(undefined.squeeze(-1), float("nan"), entropy)


def vocab_parallel_kl_div(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    reverse: bool = False,
    tp_group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Per-token `KL(teacher || student)`, or `KL(student || teacher)` with `reverse=True`.

    Both logits must be sharded the same way. A token that the second distribution masks to `-inf` while the
    first gives it probability makes the KL `+inf`.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits {tuple(teacher_logits.shape)} must "
            f"have the same shape (and vocabulary sharding)"
        )
    log_s, und_s = _log_softmax(student_logits, tp_group)
    log_t, und_t = _log_softmax(teacher_logits, tp_group)
    log_a, log_b = (log_s, log_t) if reverse else (log_t, log_s)
    mismatch = (log_b == _NEG_INF) & (log_a != _NEG_INF)
    terms = _p_times(log_a, torch.where(mismatch, 0.0, log_a - torch.where(log_b == _NEG_INF, 0.0, log_b)))
    terms = torch.where(mismatch, float("inf"), terms)
    kl = AllReduceSum.apply(terms.sum(dim=-1), tp_group)
    return torch.where((und_s | und_t).squeeze(-1), float("nan"), kl)
