"""DistributedAttention on 2 and 4 gloo ranks equals unsharded attention: outputs and q/k/v grads to 1e-6 (fp32)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ds_comm.testing import run_ranks

TOL = {"atol": 1e-6, "rtol": 1e-6}


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int, causal: bool = True
) -> torch.Tensor:
    """Plain softmax attention on `[s, b, h, d]` (seq_dim 0) or `[b, s, h, d]` (seq_dim 1), kv heads repeated."""
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if seq_dim == 0 else (lambda t: t.permute(0, 2, 1, 3))
    q, k, v = to_bhsd(q), to_bhsd(k), to_bhsd(v)
    if k.size(1) != q.size(1):
        k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
        v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    if causal:
        s = q.size(2)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v
    return out.permute(2, 0, 1, 3) if seq_dim == 0 else out.permute(0, 2, 1, 3)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, seq_dim: int, causal: bool = True
) -> torch.Tensor:
    """torch's scaled_dot_product_attention on the same layouts, heads x head_dim merged in the result."""
    to_bhsd = (lambda t: t.permute(1, 2, 0, 3)) if seq_dim == 0 else (lambda t: t.permute(0, 2, 1, 3))
    out = F.scaled_dot_product_attention(
        to_bhsd(q), to_bhsd(k), to_bhsd(v), is_causal=causal, enable_gqa=k.size(2) != q.size(2)
    )
    out = out.permute(2, 0, 1, 3) if seq_dim == 0 else out.permute(0, 2, 1, 3)
    return out.flatten(2)  # [.., h * d]: DistributedAttention also handles a merged heads dim


LOCAL = {"eager": eager_attention, "sdpa": sdpa_attention}


def _case(
    rank: int,
    world: int,
    *,
    local: str,
    batch_dim_idx: int,
    heads: tuple[int, int],
    seq: int = 8,
    batch: int = 2,
    head_dim: int = 4,
) -> dict[str, Any]:
    import functools

    import torch.distributed as dist

    from ds_parallel import DistributedAttention

    seq_dim = 1 - batch_dim_idx
    hq, hkv = heads
    gen = torch.Generator().manual_seed(1234)

    def make(h: int) -> torch.Tensor:
        shape = [seq, batch, h, head_dim] if seq_dim == 0 else [batch, seq, h, head_dim]
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    q, k, v = make(hq), make(hkv), make(hkv)
    attn = functools.partial(LOCAL[local], seq_dim=seq_dim)
    # The reference: unsharded attention, loss against fixed random weights.
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attn(*ref_in)
    weight = torch.randn(ref_out.shape, generator=gen)
    (ref_out * weight).sum().backward()

    dist_attn = DistributedAttention(attn, dist.group.WORLD, scatter_idx=2, gather_idx=0)
    mine = [t.chunk(world, dim=seq_dim)[rank].clone().requires_grad_() for t in (q, k, v)]
    out = dist_attn(*mine, batch_dim_idx)
    (out * weight.chunk(world, dim=seq_dim)[rank]).sum().backward()
    errors = {"out": (out.detach(), ref_out.detach().chunk(world, dim=seq_dim)[rank])}
    for name, t, r in zip("qkv", mine, ref_in, strict=True):
        errors[f"d{name}"] = (t.grad, r.grad.chunk(world, dim=seq_dim)[rank])
    for name, (got, want) in errors.items():
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
    return {name: float((got - want).abs().max()) for name, (got, want) in errors.items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("local", ["eager", "sdpa"])
@pytest.mark.parametrize("batch_dim_idx", [1, 0])
def test_matches_unsharded_attention(world: int, local: str, batch_dim_idx: int) -> None:
    results = run_ranks(world, _case, local=local, batch_dim_idx=batch_dim_idx, heads=(8, 8), timeout_s=120)
    assert len(results) == world


@pytest.mark.parametrize("world", [2, 4])
def test_uneven_heads_match(world: int) -> None:
    """6 heads over 4 ranks (2, 2, 1, 1) and 3 heads over 2 ranks (2, 1)."""
    heads = 6 if world == 4 else 3
    run_ranks(world, _case, local="eager", batch_dim_idx=0, heads=(heads, heads), timeout_s=120)


@pytest.mark.parametrize("world", [2, 4])
def test_grouped_query_attention_matches(world: int) -> None:
    run_ranks(world, _case, local="sdpa", batch_dim_idx=1, heads=(8, 4), timeout_s=120)


def _refusals(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from ds_parallel import DistributedAttention

    attn = DistributedAttention(lambda q, k, v: q, dist.group.WORLD)
    msgs = []
    for hq, hkv in ((2, 2), (8, 2), (6, 3)):  # fewer heads than ranks; GQA not divisible by 4
        q, kv = torch.zeros(2, 1, hq, 4), torch.zeros(2, 1, hkv, 4)
        try:
            attn(q, kv, kv, 1)
        except ValueError as err:
            msgs.append(str(err))
    return msgs


def test_bad_head_counts_are_refused_by_name() -> None:
    msgs = run_ranks(4, _refusals, timeout_s=120)[0]
    assert len(msgs) == 3, msgs
    assert "query has 2 heads" in msgs[0] and "fewer than the 4" in msgs[0]
    assert "8/2/2" in msgs[1] or "key has 2 heads" in msgs[1]
    assert "6/3/3" in msgs[2]
