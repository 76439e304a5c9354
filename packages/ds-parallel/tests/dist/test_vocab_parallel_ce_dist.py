"""Vocabulary-parallel losses on 2 gloo ranks equal `F.cross_entropy` on the full logits (float64, 1e-6).

One job runs every case: the vocabulary split over the 2 ranks as tensor parallelism (even and uneven
shards), the sequence split over them as sequence parallelism, the fused linear CE with a vocabulary-parallel
weight, and the log-prob / entropy / KL ops. Gradients are compared on each rank's own shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ds_comm.testing import run_ranks

TOL = {"atol": 1e-6, "rtol": 1e-6}
VOCAB, HID = 23, 8


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rank: int) -> float:
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"rank {rank} {what}: {m}")
    return float((got - want).detach().abs().max()) if got.numel() else 0.0


def _cases(rank: int, world: int) -> dict[str, float]:
    import torch.distributed as dist

    from ds_parallel.sequence import (
        vocab_parallel_cross_entropy,
        vocab_parallel_entropy,
        vocab_parallel_kl_div,
        vocab_parallel_linear_cross_entropy,
        vocab_parallel_logprobs,
        vocab_sequence_parallel_cross_entropy,
    )

    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 10, VOCAB, generator=gen, dtype=torch.float64) * 2
    target = torch.randint(0, VOCAB, (2, 10), generator=gen)
    target[1, 4:7] = -100
    teacher = torch.randn(2, 10, VOCAB, generator=gen, dtype=torch.float64)
    errs: dict[str, Any] = {}

    def ref_ce(reduction: str) -> tuple[torch.Tensor, torch.Tensor]:
        full = logits.clone().requires_grad_()
        loss = F.cross_entropy(full.flatten(0, 1), target.flatten(), reduction=reduction)
        return loss.view(target.shape) if reduction == "none" else loss, full

    # Tensor parallel: vocabulary columns split unevenly (12 | 11) with explicit bounds, and evenly (inferred).
    for name, bounds in (("uneven", [0, 12, VOCAB]), ("even", None)):
        cols = logits[..., :22] if bounds is None else logits
        lo, hi = (bounds[rank], bounds[rank + 1]) if bounds else (rank * 11, rank * 11 + 11)
        for reduction in ("mean", "none"):
            mine = cols[..., lo:hi].clone().requires_grad_()
            kw = {"vocab_start_index": lo, "vocab_end_index": hi} if bounds else {}
            tgt = target if bounds else target.clamp(max=21)
            got = vocab_parallel_cross_entropy(mine, tgt, tp_group=group, reduction=reduction, **kw)
            full = cols.clone().requires_grad_()
            want = F.cross_entropy(full.flatten(0, 1), tgt.flatten(), reduction=reduction).view_as(got)
            weight = torch.linspace(0.5, 1.5, got.numel(), dtype=torch.float64).view_as(got)
            (got * weight).sum().backward()
            (want * weight).sum().backward()
            errs[f"tp_{name}_{reduction}"] = _close(got, want, f"tp {name} {reduction}", rank)
            errs[f"tp_{name}_{reduction}_grad"] = _close(mine.grad, full.grad[..., lo:hi], "tp grad", rank)

    # Sequence parallel: each rank owns 5 of the 10 positions (dim 1 after moving the sequence first).
    seq_first = logits.transpose(0, 1)
    tgt_first = target.transpose(0, 1)
    sl = slice(rank * 5, rank * 5 + 5)
    for reduction in ("mean", "sum"):
        mine = seq_first[sl].clone().requires_grad_()
        got = vocab_parallel_cross_entropy(mine, tgt_first[sl], sp_group=group, reduction=reduction)
        want, full = ref_ce(reduction)
        want.backward()
        got.backward()
        errs[f"sp_{reduction}"] = _close(got, want, f"sp {reduction}", rank)
        errs[f"sp_{reduction}_grad"] = _close(mine.grad, full.grad.transpose(0, 1)[sl], "sp grad", rank)
    mine = seq_first[sl].clone().requires_grad_()
    got = vocab_sequence_parallel_cross_entropy(mine, tgt_first[sl], group)
    want, full = ref_ce("none")
    errs["sp_gathered"] = _close(got, want.transpose(0, 1), "sp gathered", rank)
    got.sum().backward()
    want.sum().backward()
    errs["sp_gathered_grad"] = _close(mine.grad, full.grad.transpose(0, 1)[sl], "sp gathered grad", rank)

    # Fused linear CE with this rank's rows of a vocabulary-parallel LM head.
    hidden = torch.randn(2, 10, HID, generator=gen, dtype=torch.float64)
    weight = torch.randn(22, HID, generator=gen, dtype=torch.float64)
    tgt = target.clamp(max=21)
    h_mine, w_mine = hidden.clone().requires_grad_(), weight[rank * 11 : rank * 11 + 11].clone().requires_grad_()
    got = vocab_parallel_linear_cross_entropy(h_mine, w_mine, tgt, tp_group=group, chunk_size=3)
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    want = F.cross_entropy(F.linear(h_ref, w_ref).flatten(0, 1), tgt.flatten())
    got.backward()
    want.backward()
    errs["linear_tp"] = _close(got, want, "linear tp", rank)
    errs["linear_tp_dhidden"] = _close(h_mine.grad, h_ref.grad, "linear dhidden", rank)
    errs["linear_tp_dweight"] = _close(w_mine.grad, w_ref.grad[rank * 11 : rank * 11 + 11], "linear dweight", rank)

    # Log-probs, entropy and KL over the even vocabulary split.
    s_full, t_full = logits[..., :22].clone().requires_grad_(), teacher[..., :22]
    s_mine = logits[..., rank * 11 : rank * 11 + 11].clone().requires_grad_()
    t_mine = t_full[..., rank * 11 : rank * 11 + 11]
    got = [
        vocab_parallel_logprobs(s_mine, tgt, tp_group=group),
        vocab_parallel_entropy(s_mine, tp_group=group),
        vocab_parallel_kl_div(s_mine, t_mine, tp_group=group),
        vocab_parallel_kl_div(s_mine, t_mine, reverse=True, tp_group=group),
    ]
    ls, lt = s_full.log_softmax(-1), t_full.log_softmax(-1)
    want = [
        torch.where(tgt == -100, 0.0, ls.gather(-1, tgt.clamp_min(0).unsqueeze(-1)).squeeze(-1)),
        -(ls.exp() * ls).sum(-1),
        (lt.exp() * (lt - ls)).sum(-1),
        (ls.exp() * (ls - lt)).sum(-1),
    ]
    for name, g, w in zip(("logprobs", "entropy", "kl", "reverse_kl"), got, want, strict=True):
        errs[name] = _close(g, w, name, rank)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    errs["ops_grad"] = _close(s_mine.grad, s_full.grad[..., rank * 11 : rank * 11 + 11], "ops grad", rank)
    return errs


def test_vocab_and_sequence_parallel_losses_match_full_logits() -> None:
    results = run_ranks(2, _cases, timeout_s=120)
    assert len(results) == 2 and all(len(r) == 22 for r in results), results
    assert max(max(r.values()) for r in results) <= 1e-6
