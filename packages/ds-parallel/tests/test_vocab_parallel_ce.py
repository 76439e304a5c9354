"""Vocabulary-parallel and fused linear cross entropy on one process equal `F.cross_entropy` on the full logits.

float64 throughout: values and gradients to 1e-6 (in practice ~1e-15). The sharded (TP/SP = 2) cases run in
tests/dist/test_vocab_parallel_ce_dist.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ds_parallel.sequence import (
    VocabParallelCausalLMLoss,
    vocab_parallel_cross_entropy,
    vocab_parallel_entropy,
    vocab_parallel_kl_div,
    vocab_parallel_linear_cross_entropy,
    vocab_parallel_logprobs,
)

TOL = {"atol": 1e-6, "rtol": 1e-6}


def _data(tokens: int = 12, vocab: int = 37, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, tokens, vocab, generator=gen, dtype=torch.float64) * 3
    target = torch.randint(0, vocab, (2, tokens), generator=gen)
    target[0, :3] = -100
    return logits, target


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_cross_entropy_matches_torch(reduction: str) -> None:
    logits, target = _data()
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = vocab_parallel_cross_entropy(mine, target, reduction=reduction)
    want = F.cross_entropy(ref.flatten(0, 1), target.flatten(), reduction=reduction).view_as(got)
    torch.testing.assert_close(got, want, **TOL)
    weight = torch.rand_like(got)
    (got * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(mine.grad, ref.grad, **TOL)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [None, 5])
def test_linear_cross_entropy_matches_torch(bias: bool, chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, 16, generator=gen, dtype=torch.float64)
    weight = torch.randn(41, 16, generator=gen, dtype=torch.float64)
    b = torch.randn(41, generator=gen, dtype=torch.float64) if bias else None
    target = torch.randint(0, 41, (3, 7), generator=gen)
    target[1, 2:5] = -100
    params = [t for t in (hidden, weight, b) if t is not None]
    mine = [t.clone().requires_grad_() for t in params]
    ref = [t.clone().requires_grad_() for t in params]
    got = vocab_parallel_linear_cross_entropy(
        mine[0], mine[1], target, bias=mine[2] if bias else None, chunk_size=chunk
    )
    want = F.cross_entropy(F.linear(ref[0], ref[1], ref[2] if bias else None).flatten(0, 1), target.flatten())
    torch.testing.assert_close(got, want, **TOL)
    got.backward()
    want.backward()
    for g, r in zip(mine, ref, strict=True):
        torch.testing.assert_close(g.grad, r.grad, **TOL)


def test_logprobs_entropy_kl_match_torch() -> None:
    logits, target = _data(seed=2)
    teacher = torch.randn_like(logits)
    teacher[0, 0, 5] = float("-inf")  # a masked token in the teacher only
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp = vocab_parallel_logprobs(mine, target)
    ent = vocab_parallel_entropy(mine)
    kl = vocab_parallel_kl_div(mine, teacher)
    rkl = vocab_parallel_kl_div(mine, teacher, reverse=True)
    log_p, log_t = ref.log_softmax(-1), teacher.log_softmax(-1)
    ref_lp = torch.where(target == -100, 0.0, log_p.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1))
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    t_p = log_t.exp()
    ref_kl = torch.where(t_p > 0, t_p * (log_t - log_p), 0.0).sum(-1)
    ref_rkl = (log_p[1].exp() * (log_p[1] - log_t[1])).sum(-1)  # row 1: no -inf
    torch.testing.assert_close(rkl[0, 0], torch.tensor(float("inf"), dtype=torch.float64))
    got = [lp, ent, kl, rkl[1]]
    want = [ref_lp, ref_ent, ref_kl, ref_rkl]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(mine.grad, ref.grad, **TOL)


def test_all_masked_row_is_nan_with_zero_grad() -> None:
    logits = torch.randn(3, 5, dtype=torch.float64)
    logits[1] = float("-inf")
    x = logits.clone().requires_grad_()
    ent = vocab_parallel_entropy(x)
    assert torch.isnan(ent[1]) and torch.isfinite(ent[[0, 2]]).all()
    ent[[0, 2]].sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()


def test_causal_lm_loss_shifts_labels() -> None:
    logits, labels = _data(seed=3)
    loss = VocabParallelCausalLMLoss()(logits, labels=labels)
    want = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(loss, want, **TOL)


def test_bad_input_is_refused_by_name() -> None:
    logits, target = _data()
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match=r"outside \[0, 37\)"):
        vocab_parallel_cross_entropy(logits, target + 40)
    with pytest.raises(ValueError, match="vocab_start_index=3"):
        vocab_parallel_cross_entropy(logits, target, vocab_start_index=3, vocab_end_index=40)
    with pytest.raises(ValueError, match="chunk_size=0"):
        vocab_parallel_linear_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2), chunk_size=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_cross_entropy_matches_torch(dtype: torch.dtype) -> None:
    from ds_parallel.sequence._chunked_cross_entropy import ChunkedCausalLMLoss, chunked_cross_entropy

    logits, target = _data(seed=5)
    logits, target = logits.flatten(0, 1).to(dtype), target.flatten()
    mine, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = chunked_cross_entropy(mine, target, block_rows=5)
    want = F.cross_entropy(ref.float(), target)
    tol = TOL if dtype == torch.float64 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got, want.to(got.dtype), **tol)
    got.backward()
    want.backward()
    torch.testing.assert_close(mine.grad, ref.grad, **tol)
    labels = torch.randint(0, 37, (2, 12))
    hf = ChunkedCausalLMLoss(block_rows=3)(logits.view(2, 12, 37), labels, 37)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
    torch.testing.assert_close(hf, F.cross_entropy(logits.float(), shifted.flatten()).to(hf.dtype), **tol)
    with pytest.raises(ValueError, match="block_rows=0"):
        chunked_cross_entropy(logits, target, block_rows=0)
